"""The weight files a launch of a config would read: those SGLang's default loader reads for its
`--model-path` and `--speculative-draft-model-path` (a local folder, a local file, or a Hugging
Face id already in the hub cache the server would use): the safetensors its index names, else
all of them, else `*.bin`, else `*.pt`/`*.pth`, at the folder's top level. Nothing is
downloaded; nothing found is an empty answer. A swap pre-warms them (`prewarm.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .resolvedconfig import ResolvedConfig

WEIGHT_OPTIONS = ("--model-path", "--speculative-draft-model-path")
SUFFIX_ORDER = ((".safetensors",), (".bin",), (".pt", ".pth"))
SINGLE_FILES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
INDEX = "model.safetensors.index.json"


def _hub_dirs(env: Mapping[str, str]) -> list[Path]:
    """The hub caches the server would look in, as huggingface_hub reads its variables."""
    if env.get("HF_HUB_CACHE"):
        return [Path(env["HF_HUB_CACHE"]).expanduser()]
    if env.get("HUGGINGFACE_HUB_CACHE"):
        return [Path(env["HUGGINGFACE_HUB_CACHE"]).expanduser()]
    if env.get("HF_HOME"):
        return [Path(env["HF_HOME"]).expanduser() / "hub"]
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return [Path(xdg) / "huggingface" / "hub"]


def _snapshot(repo_id: str, revision: str | None, env: Mapping[str, str]) -> Path | None:
    """The local snapshot of a hub model id (`org/name`), if the cache has it."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    for hub in _hub_dirs(env):
        repo = hub / ("models--" + repo_id.replace("/", "--"))
        rev = revision or "main"
        try:
            ref = (
                (repo / "refs" / rev).read_text().strip()
                if (repo / "refs" / rev).is_file()
                else rev
            )
        except OSError:
            continue
        snap = repo / "snapshots" / ref
        if ref and "/" not in ref and snap.is_dir():
            return snap
    return None


def _folder_weights(folder: Path) -> list[Path]:
    """The files SGLang's default loader reads from a model folder (its top level)."""
    try:
        names = sorted(p for p in folder.iterdir() if p.is_file())
    except OSError:
        return []
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            named = (
                {folder / str(v) for v in weight_map.values()}
                if isinstance(weight_map, dict)
                else set()
            )
        except (OSError, ValueError, AttributeError):
            named = set()
        listed = [p for p in names if p in named]
        if listed:
            return listed
    for suffixes in SUFFIX_ORDER:
        found = [p for p in names if p.name.endswith(suffixes)]
        if found:
            return found
    return []


def weight_files(cfg: ResolvedConfig, env: Mapping[str, str]) -> tuple[Path, ...]:
    """The weight files a launch of `cfg` would read (none known: empty)."""
    out: list[Path] = []
    revision = cfg.server_option("--revision")
    for option in WEIGHT_OPTIONS:
        value = cfg.model_path if option == "--model-path" else cfg.server_option(option)
        if not value:
            continue
        path = Path(value).expanduser()
        if path.is_file() and path.name.endswith(SINGLE_FILES):
            found = [path]
        elif path.is_dir():
            found = _folder_weights(path)
        else:
            snap = _snapshot(value, revision if option == "--model-path" else None, env)
            found = _folder_weights(snap) if snap is not None else []
        out += [p for p in found if p not in out]
    return tuple(out)
