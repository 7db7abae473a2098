"""Named configs' files: ``configs/NAME.yaml``, ``extends:``, the limits of what is read, the store.

``extends`` merges mappings deeply and replaces lists. Every error names the file, the line and
the reason. A config is read again only when a file it was read from (or looked for) changes.
What a file may say, and how its ``args`` become flags: ``configschema.py``; what a config
resolves to (argv, address, secrets masked): ``resolvedconfig.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from . import errors
from .configschema import ServerConfig
from .resolvedconfig import ResolvedConfig
from .safefile import YamlLimit, load_yaml, read_regular_text

# A config is a few hundred lines; anything near this is a mistake or an attack.
CONFIG_MAX_BYTES = 1024 * 1024

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ConfigError(Exception):
    """A config that cannot be used; `kind` is the refusal it makes of a command that names it
    (`errors.INVALID_CONFIG`, `NOT_FOUND` or `BAD_REQUEST` for a bad name)."""

    def __init__(
        self, message: str, kind: str = errors.INVALID_CONFIG, path: Path | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.path = path


class ConfigNotFound(ConfigError):
    def __init__(self, message: str) -> None:
        super().__init__(message, kind=errors.NOT_FOUND)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _line_of(path: Path, text: str, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the key at `loc` in a YAML document, if it can be found."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(key):
                    line = k.start_mark.line + 1
                    node = v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _stamp(path: Path) -> tuple[int, int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


Stamps = tuple[tuple[Path, tuple[int, int, int]], ...]


def _still(stamps: Stamps) -> bool:
    """Whether no file of `stamps` changed since (a stat of each, nothing read)."""
    return all(_stamp(p) == st for p, st in stamps)


class ConfigStore:
    """Reads named configs from one folder. A config is read again only when a file it was
    read from (or looked for) changes: resolved configs and failures are both remembered."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # name -> (stamps of every file in its extends chain, the resolved config)
        self._cache: dict[str, tuple[Stamps, ResolvedConfig]] = {}
        # name -> (stamps of every file its failed load looked at, the error): a broken config
        # is read again only once one of them changes (a 0.9 MB one took ~4 s per request).
        self._failed: dict[str, tuple[Stamps, ConfigError]] = {}

    def names(self) -> list[str]:
        try:
            entries = sorted(self.folder.iterdir())
        except FileNotFoundError:
            return []
        return [p.stem for p in entries if p.suffix in (".yaml", ".yml") and NAME_RE.match(p.stem)]

    def path_of(self, name: str) -> Path:
        """The file of a config name; bad names are 400, missing ones 404."""
        if not NAME_RE.match(name):
            raise ConfigError(
                f"invalid config name {name!r}: must match {NAME_RE.pattern}",
                kind=errors.BAD_REQUEST,
            )
        root = self.folder.resolve()
        for suffix in (".yaml", ".yml"):
            candidate = self.folder / f"{name}{suffix}"
            if candidate.exists() or candidate.is_symlink():
                real = candidate.resolve()
                if root not in real.parents:
                    raise ConfigError(
                        f"config {name!r} is a link that leaves {self.folder}",
                        kind=errors.BAD_REQUEST,
                    )
                return candidate
        raise ConfigNotFound(f"unknown config {name!r}: no {self.folder / name}.yaml")

    def _read(
        self, name: str, consulted: list[tuple[Path, tuple[int, int, int]]]
    ) -> tuple[Path, str, dict[str, Any]]:
        if NAME_RE.match(name):  # where it is looked for (stamped before it is read)
            for suffix in (".yaml", ".yml"):
                consulted.append(
                    (self.folder / f"{name}{suffix}", _stamp(self.folder / f"{name}{suffix}"))
                )
        path = self.path_of(name)
        try:
            text = read_regular_text(path, CONFIG_MAX_BYTES)
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror or exc}", path=path) from None
        try:
            data = load_yaml(text)
        except YamlLimit as exc:
            raise ConfigError(f"{path}: refused: {exc}", path=path) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{where}: invalid YAML: {problem}", path=path) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}:1: a config must be a mapping", path=path)
        return path, text, data

    def unchanged(self, name: str) -> ResolvedConfig | None:
        """The config as last resolved, if no file of its chain changed since (a stat of each,
        nothing read); None when it must be read again."""
        cached = self._cache.get(name)
        if cached is not None and _still(cached[0]):
            return cached[1]
        return None

    def load(self, name: str) -> ResolvedConfig:
        """Resolve a config; re-read only when a file of its chain changed. A config that
        failed fails again, with the same error, until a file it looked at changes."""
        cached = self.unchanged(name)
        if cached is not None:
            return cached
        failed = self._failed.get(name)
        if failed is not None and _still(failed[0]):
            raise copy.copy(failed[1])  # a fresh exception: no traceback piling up
        consulted: list[tuple[Path, tuple[int, int, int]]] = []
        try:
            resolved = self._load(name, consulted)
        except ConfigError as exc:
            self._remember_failure(name, consulted, exc)
            raise
        except Exception as exc:  # whatever a hostile file provokes is still a config error
            path = self.folder / f"{name}.yaml"
            error = ConfigError(f"{path}: cannot be read ({type(exc).__name__}: {exc})", path=path)
            self._remember_failure(name, consulted, error)
            raise error from exc
        self._failed.pop(name, None)
        self._cache[name] = (tuple((p, _stamp(p)) for p in resolved.files), resolved)
        return resolved

    def _remember_failure(
        self, name: str, consulted: list[tuple[Path, tuple[int, int, int]]], error: ConfigError
    ) -> None:
        if consulted:  # (a bad name looked at nothing, and costs nothing to refuse again)
            self._failed[name] = (tuple(consulted), error)

    def _load(
        self, name: str, consulted: list[tuple[Path, tuple[int, int, int]]]
    ) -> ResolvedConfig:
        chain: list[str] = []
        layers: list[tuple[Path, str, dict[str, Any]]] = []
        current: str | None = name
        while current is not None:
            if current in chain:
                cycle = " → ".join([*chain, current])
                raise ConfigError(f"{layers[-1][0]}: extends cycle: {cycle}", path=layers[-1][0])
            chain.append(current)
            try:
                path, text, data = self._read(current, consulted)
            except ConfigNotFound as exc:
                if not layers:
                    raise
                child = layers[-1]
                line = _line_of(child[0], child[1], ("extends",))
                raise ConfigError(
                    f"{child[0]}:{line}: extends: unknown config {current!r} "
                    f"(no {self.folder / current}.yaml)",
                    path=child[0],
                ) from exc
            layers.append((path, text, data))
            parent = data.get("extends")
            if parent is not None and not isinstance(parent, str):
                line = _line_of(path, text, ("extends",))
                raise ConfigError(f"{path}:{line}: extends must be a config name", path=path)
            current = parent
        # Validate each file on its own first, so an error points at the right file and line.
        for path, text, data in layers:
            self._validate(path, text, data)
        merged: dict[str, Any] = {}
        for _, _, data in reversed(layers):
            merged = deep_merge(merged, {k: v for k, v in data.items() if k != "extends"})
        config = self._validate(layers[0][0], layers[0][1], merged, merged_from=len(layers) > 1)
        canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True)
        return ResolvedConfig(
            name=name,
            config=config,
            argv=config.argv(),
            config_hash=hashlib.sha256(canonical.encode()).hexdigest()[:12],
            files=tuple(p for p, _, _ in layers),
        )

    @staticmethod
    def _validate(
        path: Path, text: str, data: dict[str, Any], merged_from: bool = False
    ) -> ServerConfig:
        try:
            return ServerConfig.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = tuple(err["loc"])
            line = None if merged_from else _line_of(path, text, loc)
            where = f"{path}:{line}" if line else str(path)
            key = ".".join(str(p) for p in loc) or "(root)"
            more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
            raise ConfigError(f"{where}: {key}: {err['msg']}{more}", path=path) from None
