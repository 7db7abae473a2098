"""Named server configs: ``configs/NAME.yaml``, with ``extends:`` and argv built without a shell.

``extends`` merges mappings deeply and replaces lists. Every error names the file, the line and
the reason. What a file may say, and how its ``args`` become flags: ``configschema.py``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import ValidationError

from gpuwarden.standin.argspec import split_command

from . import errors
from .configschema import ServerConfig, build_argv
from .launchsecrets import ArgvSecrets, argv_secrets, redact_env, secret_values
from .redact import MASK, Redactor, longest_first, mask_url_passwords, url_passwords
from .safefile import YamlLimit, load_yaml, read_regular_text

# A config is a few hundred lines; anything near this is a mistake or an attack.
CONFIG_MAX_BYTES = 1024 * 1024

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SGLANG_DEFAULT_PORT = 30000


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


def option_value(argv: Sequence[str], option: str, parser: ArgvSecrets) -> str | None:
    """The value argparse gives `option` (a long option taking one value, ``--port``) in a
    server's argv: the last occurrence wins; ``--port N`` and ``--port=N``; an abbreviation
    (``--po N``) counts when it stands for `option` alone among the options of the server's
    parser (`parser.options`; SGLang's for SGLang and the stand-in). With no known parser only
    `option` itself counts. None when the argv does not give it (the server's default).

    Every consumer of the server's address (probes, the listener check, preflight, swaps,
    sweeps, `/metrics`) reads it through here, so a ``--port`` in ``command:``, an ``args`` key
    ``"--port"`` and ``port:`` are one and the same."""
    args = split_command(argv).args
    value: str | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            break  # argparse: everything after is positional
        if not arg.startswith("--"):
            continue
        flag, eq, attached = arg.partition("=")
        meant = parser.resolve(flag) if parser.options is not None else [flag]
        if meant != [option]:
            continue
        if eq:
            value = attached
        elif i < len(args) and not args[i].startswith("-"):
            value = args[i]
            i += 1
    return value


@dataclass(frozen=True)
class ResolvedConfig:
    name: str
    config: ServerConfig
    argv: list[str]
    config_hash: str
    files: tuple[Path, ...]

    @property
    def env(self) -> dict[str, str]:
        """The variables this config sets."""
        return {k: v for k, v in self.config.env.items() if v is not None}

    @property
    def unset_env(self) -> list[str]:
        """The variables this config removes from the server's environment (`NAME: null`)."""
        return [k for k, v in self.config.env.items() if v is None]

    def process_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The server's environment: `base` (the daemon's) with this config's changes."""
        env = {**base, **self.env}
        for name in self.unset_env:
            env.pop(name, None)
        return env

    def server_option(self, option: str) -> str | None:
        """The value the server's own parser gives `option` (``--port``) in the final argv, or
        None when the argv does not give it (see `option_value`)."""
        return option_value(self.argv, option, self.argv_secrets)

    @property
    def port(self) -> int:
        """The server's port, as its parser reads the argv (`command:` and `args` alike);
        SGLang's default when not given or not a number."""
        value = self.server_option("--port")
        try:
            return int(value) if value is not None else SGLANG_DEFAULT_PORT
        except ValueError:
            return SGLANG_DEFAULT_PORT

    @property
    def host(self) -> str:
        """The address to reach the server at: its `--host`, loopback for a wildcard bind."""
        value = self.server_option("--host")
        if value is None or value in ("0.0.0.0", "::", ""):
            return "127.0.0.1"
        return value

    @property
    def health_url(self) -> str:
        if self.config.health.url:
            return self.config.health.url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/health"

    @property
    def metrics_url(self) -> str | None:
        """The server's own Prometheus endpoint, when its argv turns it on (SGLang's
        `--enable-metrics`): the health URL's scheme, host and port, path `/metrics`."""
        if "--enable-metrics" not in self.argv:
            return None
        parts = urlsplit(self.health_url)
        return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))

    @property
    def gpus(self) -> list[str] | None:
        """GPUs to watch (indexes or UUIDs as strings): `gpus`, else CUDA_VISIBLE_DEVICES."""
        if self.config.gpus is not None:
            return [str(g) for g in self.config.gpus]
        cvd = self.config.env.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None:
            return [t.strip() for t in cvd.split(",") if t.strip()]
        return None

    @property
    def argv_secrets(self) -> ArgvSecrets:
        """Which of this config's flags carry secrets: judged by the server's parser when it is
        known and readable (SGLang, the stand-in), else by name."""
        return argv_secrets(self.argv, parser_known=self.config.preflight.argv)

    def redacted_argv(self) -> list[str]:
        # Every item of a secret arg's list is masked, whatever the parser makes of it.
        masker = Redactor(longest_first(self._secret_args()))
        return [masker.text(a) for a in self.argv_secrets.redact(self.argv)]

    def _secret_args(self) -> list[str]:
        """The values of `args` keys that name secrets (each item of a list)."""
        policy = self.argv_secrets
        out: list[str] = []
        for key, value in self.config.args.items():
            if policy.is_secret(key if key.startswith("-") else f"--{key}"):
                items = value if isinstance(value, list) else [value]
                out += [str(v) for v in items if v is not None and not isinstance(v, bool)]
        return out

    def secret_values(self) -> list[str]:
        """The literal secrets of a launch of this config, to be masked wherever they appear:
        its secret flags' and variables' values and the passwords of its URLs (health.url
        too)."""
        values = secret_values(self.argv, self.env, self.argv_secrets)
        values += self._secret_args() + url_passwords(self.config.health.url or "")
        return longest_first(values)

    @property
    def shown_health_url(self) -> str:
        """The health URL as shown: a password in it masked."""
        return mask_url_passwords(self.health_url)

    def redacted_env(self) -> dict[str, str | None]:
        """The env overrides with secrets masked; None marks a variable the config unsets."""
        masked = redact_env(self.env)
        return {k: masked.get(k) for k in self.config.env}

    def view(self) -> dict[str, Any]:
        """What the API shows of a config: resolved, with secrets masked."""
        data = self.config.model_dump(mode="json")
        data["env"] = self.redacted_env()
        secrets = self.argv_secrets
        # `command` may hold flags too (`[sglang, serve, --api-key=...]`).
        data["command"] = secrets.redact(self.config.command)
        data["args"] = {
            key: MASK
            if secrets.is_secret(key if key.startswith("-") else f"--{key}")
            else _masked_urls(value)
            for key, value in data["args"].items()
        }
        if data["health"].get("url"):
            data["health"]["url"] = mask_url_passwords(data["health"]["url"])
        return {
            "name": self.name,
            "config": data,
            "argv": self.redacted_argv(),
            "config_hash": self.config_hash,
            "health_url": self.shown_health_url,
            "gpus": self.gpus,
            "files": [str(f) for f in self.files],
        }


def _masked_urls(value: Any) -> Any:
    """An `args` value with the passwords of its URLs masked (in each item of a list)."""
    if isinstance(value, str):
        return mask_url_passwords(value)
    if isinstance(value, list):
        return [_masked_urls(v) for v in value]
    return value


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
            argv=build_argv(config.command, config.args),
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


def redacted_header_lines(cfg: ResolvedConfig) -> list[str]:
    env = " ".join(f"{k}={v}" for k, v in cfg.redacted_env().items() if v is not None)
    if cfg.unset_env:
        env = f"{env}; unset: {' '.join(cfg.unset_env)}".lstrip("; ")
    return [
        f"config: {cfg.name} (hash {cfg.config_hash}; {', '.join(str(f) for f in cfg.files)})",
        f"argv: {' '.join(cfg.redacted_argv())}",
        f"env overrides: {env or '(none)'}",
    ]
