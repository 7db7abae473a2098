"""JIT and compile caches that outlive each launch: one folder per (GPU model, SGLang version,
torch version) under `compile_cache.dir`, given to every launch through the variables SGLang
0.5.23 and its kernels read (`CACHE_VARS`; SGLang's own layout under `SGLANG_CACHE_DIR`, so a
folder can be copied, warmed or mounted as one).

A config (or the daemon's environment) that sets any of these variables manages its caches
itself: gpuwarden then sets none of them. The versions are those of the server's interpreter,
asked once per interpreter (`learn`, before the launch's GPU wait) and asked again when its
packages change (their metadata folders are stat'ed at each launch: microseconds). A command
that is not a Python of SGLang (or the stand-in) gets the `unknown` versions' folder.

Sizes are read off the loop once a launch has been ready for 5 s (`host.py`), and folders are
pruned then: the least recently used first, past `keep` folders or `max_bytes` in all, never
one in use. Only folders gpuwarden made are ever counted or removed (named as `folder_name`
names them, with its mark inside): anything else under `compile_cache.dir` is left alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.standin.argspec import split_command

from .model import utc_iso
from .server.helpers import run_helper
from .serverparser import server_interpreter
from .settings import CompileCacheSettings

LEARN_TIMEOUT_S = 30.0
USED_MARK = ".last_used"  # touched at each launch that uses the folder

# What SGLang 0.5.23 and its kernels read (`sglang.srt.environ`: SGLANG_CACHE_DIR, its JIT
# and DeepGEMM folders, and `third_party_cache_defaults`), relative to the folder.
CACHE_VARS: dict[str, str] = {
    "SGLANG_CACHE_DIR": "",
    "SGLANG_JIT_CACHE_DIR": "jit",
    "SGLANG_DG_CACHE_DIR": "deep_gemm",
    "DG_JIT_CACHE_DIR": "deep_gemm",  # DeepGEMM's own (older SGLang set it from its own)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "nv",
    "TILELANG_CACHE_DIR": "tilelang",
    "FLASHINFER_WORKSPACE_BASE": "",  # FlashInfer adds .cache/flashinfer itself
}

_PROBE = r"""
import importlib.metadata as m, json, sysconfig
out = {"site": sysconfig.get_paths()["purelib"]}
for name in ("sglang", "torch"):
    try:
        d = m.distribution(name)
        out[name] = [d.version, str(getattr(d, "_path", "") or "")]
    except Exception:
        out[name] = None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Versions:
    sglang: str | None
    torch: str | None
    stamps: tuple[tuple[str, int], ...]  # its packages' folders and site-packages, as they were


# The names `folder_name` gives: only these are counted and pruned.
OURS = re.compile(r"^[a-z0-9.+-]+_sglang-[a-z0-9.+-]+_torch-[a-z0-9.+-]+$")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.+-]+", "-", text.lower()).strip("-")[:64] or "unknown"


def folder_name(gpu_model: str | None, versions: Versions | None) -> str:
    gpu = slug(gpu_model) if gpu_model else "no-gpu"
    sglang = versions.sglang if versions and versions.sglang else "unknown"
    torch = versions.torch if versions and versions.torch else "unknown"
    return f"{gpu}_sglang-{slug(sglang)}_torch-{slug(torch)}"


def folder_env(folder: Path) -> dict[str, str]:
    return {var: str(folder / sub) if sub else str(folder) for var, sub in CACHE_VARS.items()}


def _stamp(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


class CompileCaches:
    def __init__(
        self, settings: CompileCacheSettings, gpu_model: Callable[[list[str] | None], str | None]
    ) -> None:
        self.settings, self.gpu_model = settings, gpu_model
        self.root = settings.dir
        self._versions: dict[str, Versions] = {}  # by interpreter
        self._interpreters: dict[tuple[str, ...], str | None] = {}  # by argv's head and PATH
        self.in_use: str | None = None  # the folder of the latest launch
        self.folders: list[dict[str, Any]] = []  # as last read (`scan`)
        self._scanning = asyncio.Lock()  # one scan at a time: a late one never undoes another

    # -- before a launch ----------------------------------------------------------------------

    def interpreter(self, argv: list[str], env: Mapping[str, str]) -> str | None:
        """The server's Python, as its PATH finds it (remembered: a launch asks at once)."""
        key = (*argv[:3], env.get("PATH") or "")
        if key not in self._interpreters:
            self._interpreters[key] = server_interpreter(split_command(argv), env.get("PATH"))
        return self._interpreters[key]

    def known(self, argv: list[str], env: Mapping[str, str]) -> bool:
        """Its interpreter's versions are known and its packages unchanged since (or there is
        nothing to ask: caches off, no Python)."""
        if not self.settings.enabled:
            return True
        interp = self.interpreter(argv, env)
        if interp is None:
            return True
        found = self._versions.get(interp)
        return found is not None and all(_stamp(p) == s for p, s in found.stamps)

    async def learn(self, argv: list[str], env: dict[str, str]) -> None:
        """Ask the server's interpreter which SGLang and torch it has (no import of either).
        An interpreter that cannot say gets the `unknown` versions."""
        interp = self.interpreter(argv, env)
        if interp is None:
            return
        versions = Versions(None, None, ())
        try:
            res = await run_helper([interp, "-c", _PROBE], env=env, timeout_s=LEARN_TIMEOUT_S)
            data = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {}
        except (OSError, ValueError, IndexError):
            data = {}
        if isinstance(data, dict):
            found = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2}
            # What changes when a package is installed, upgraded or removed: its metadata
            # folder, and the site-packages folder that holds them all.
            watched = [str(p) for _, p in found.values() if p]
            if isinstance(data.get("site"), str):
                watched.append(data["site"])
            versions = Versions(
                str(found["sglang"][0]) if "sglang" in found else None,
                str(found["torch"][0]) if "torch" in found else None,
                tuple((p, _stamp(p)) for p in watched),
            )
        self._versions[interp] = versions

    def env_for(
        self, argv: list[str], env: Mapping[str, str], gpus: list[str] | None
    ) -> dict[str, str]:
        """The variables a launch gets (none where its env sets any of them), its folder made
        and marked used now. `gpus`: the config's (CUDA_VISIBLE_DEVICES), the first names it."""
        if not self.settings.enabled or any(var in env for var in CACHE_VARS):
            return {}
        interp = self.interpreter(argv, env)
        versions = self._versions.get(interp) if interp else None
        name = folder_name(self.gpu_model(gpus), versions)
        folder = self.root / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / USED_MARK).touch()
        except OSError:
            return {}  # a cache is no reason to fail a launch: the server's defaults apply
        self.in_use = name
        return folder_env(folder)

    # -- after a launch is ready --------------------------------------------------------------

    def adopted(self, environ: Mapping[str, str]) -> None:
        """A server this daemon adopted (its environment as it runs): its folder is in use."""
        folder = Path(environ.get("SGLANG_CACHE_DIR") or "/")
        if folder.parent == self.root and OURS.match(folder.name):
            self.in_use = folder.name

    async def scan_and_prune(self) -> list[dict[str, Any]]:
        """Read the folders' sizes and prune them (off the loop); what `/status` shows."""
        async with self._scanning:
            self.folders = await asyncio.to_thread(self._scan_and_prune)
        return self.folders

    def _scan_and_prune(self) -> list[dict[str, Any]]:
        try:
            entries = [
                p
                for p in self.root.iterdir()
                if OURS.match(p.name)
                and p.is_dir()
                and not p.is_symlink()
                and (p / USED_MARK).is_file()
            ]
        except OSError:
            return []
        # (last used, name, bytes), the least recently used first
        folders = sorted((_stamp(str(p / USED_MARK)), p.name, _size(p)) for p in entries)
        total = sum(size for _, _, size in folders)
        for entry in list(folders):
            if len(folders) <= self.settings.keep and total <= self.settings.max_bytes:
                break
            # In use now (read again: a launch may have begun while the sizes were read), or
            # marked since the listing: kept.
            if entry[1] == self.in_use or _stamp(str(self.root / entry[1] / USED_MARK)) != entry[0]:
                continue
            shutil.rmtree(self.root / entry[1], ignore_errors=True)
            folders.remove(entry)
            total -= entry[2]
        return [
            {
                "name": name,
                "bytes": size,
                "last_used_at": utc_iso(used / 1e9) if used else None,
                "in_use": name == self.in_use,
            }
            for used, name, size in reversed(folders)
        ]

    def view(self) -> dict[str, Any]:
        return {
            "enabled": self.settings.enabled,
            "dir": str(self.root),
            "bytes": sum(f["bytes"] for f in self.folders),
            "folders": self.folders,
        }


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total
