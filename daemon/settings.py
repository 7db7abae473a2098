"""The daemon's settings: YAML (``--settings``), overridden by ``GPUWARDEN_<KEY>`` variables.

Every key is optional. Nested keys use ``__`` in the environment
(``GPUWARDEN_RESTART__INITIAL_DELAY_S=0``). Relative paths are relative to the settings file's
folder (the working directory without a file).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuwarden.daemon.safefile import YamlLimit, load_yaml, read_regular_text

SETTINGS_MAX_BYTES = 1024 * 1024


class SettingsError(Exception):
    """Settings that cannot be used; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Retention(_Strict):
    launches: int = Field(50, ge=1)
    max_bytes: int = Field(2 * 1024**3, ge=1)


class StateRetention(_Strict):
    """What state_dir keeps: events.jsonl's lines, saved dumps, sweep folders (the newest)."""

    events: int = Field(100_000, ge=1)
    dumps: int = Field(200, ge=1)
    sweeps: int = Field(50, ge=1)


class CompileCacheSettings(_Strict):
    """The JIT and compile caches every launch gets (`compilecache.py`): one folder per (GPU
    model, SGLang version, torch version) under `dir`, the least recently used pruned past
    `keep` folders or `max_bytes` in all."""

    enabled: bool = True
    dir: Path = Path("./cache")
    max_bytes: int = Field(50 * 1024**3, ge=1)
    keep: int = Field(8, ge=1)


class PrewarmSettings(_Strict):
    """A swap reads the next config's weight files into the page cache before the old server
    is stopped (`prewarm.py`): at most `max_read_mib_s`, never past what leaves
    `keep_free_ram_fraction` of RAM available, given up under memory pressure."""

    enabled: bool = True
    max_read_mib_s: float = Field(1024.0, gt=0)
    keep_free_ram_fraction: float = Field(0.2, ge=0, lt=1)


class ProxySettings(_Strict):
    """The front proxy (`frontproxy.py`): clients use `listen`; the server stays on its port."""

    listen: str = "127.0.0.1:30080"
    hold_timeout_s: float = Field(600.0, gt=0)  # a held request older than this gets 503
    max_held: int = Field(1000, ge=0)
    max_held_bytes: int = Field(268435456, ge=0)
    continue_streams: bool = False  # a stream cut by a dead server continues on the next one

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class RestartPolicy(_Strict):
    initial_delay_s: float = Field(10.0, ge=0)
    max_delay_s: float = Field(300.0, ge=0)
    multiplier: float = Field(2.0, ge=1)
    jitter: float = Field(0.2, ge=0, lt=1)
    reset_after_s: float = Field(600.0, ge=0)
    crash_loop_after: int = Field(3, ge=1)
    max_failures: int | None = Field(None, ge=1)
    probation_s: float = Field(60.0, ge=0)


class StopPolicy(_Strict):
    grace_s: float = Field(60.0, ge=0)


class GpuSettings(_Strict):
    backend: Literal["auto", "nvml", "fake", "none"] = "auto"
    poll_interval_s: float = Field(0.1, gt=0)
    release_timeout_s: float = Field(180.0, ge=0)
    busy_above_mib: int = Field(2048, ge=0)


class LogStreamSettings(_Strict):
    # A /logs/stream client whose socket takes nothing for this long is dropped.
    send_timeout_s: float = Field(30.0, gt=0)
    heartbeat_s: float = Field(15.0, gt=0)


class Webhook(_Strict):
    url: str
    format: Literal["slack", "generic"] = "slack"


class ChatSettings(_Strict):
    triggers: list[str] = Field(
        default_factory=lambda: ["server crashed", "server is down", "dump logs"]
    )
    verification_token: str | None = None
    signing_secret: str | None = None  # Slack's: X-Slack-Signature over the raw body
    webhooks: list[Webhook] = Field(default_factory=list)

    @field_validator("webhooks", mode="before")
    @classmethod
    def _urls_to_webhooks(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"url": v} if isinstance(v, str) else v for v in value]
        return value


class HttpLimits(_Strict):
    """Bounds on the control plane's connections: a slow or greedy client costs little."""

    max_body_bytes: int = Field(1024**2, ge=1)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    keep_alive_s: float = Field(15.0, gt=0)
    max_connections: int = Field(256, ge=1)


class Settings(_Strict):
    listen: str = "127.0.0.1:8600"
    token_file: Path | None = None
    configs_dir: Path = Path("./configs")
    default_config: str | None = None
    state_dir: Path = Path("./state")
    log_dir: Path = Path("./logs")
    log_retention: Retention = Field(default_factory=Retention)  # type: ignore[arg-type]
    compile_cache: CompileCacheSettings = Field(default_factory=CompileCacheSettings)  # type: ignore[arg-type]
    prewarm: PrewarmSettings = Field(default_factory=PrewarmSettings)  # type: ignore[arg-type]
    retention: StateRetention = Field(default_factory=StateRetention)  # type: ignore[arg-type]
    restart: RestartPolicy = Field(default_factory=RestartPolicy)  # type: ignore[arg-type]
    stop: StopPolicy = Field(default_factory=StopPolicy)  # type: ignore[arg-type]
    gpu: GpuSettings = Field(default_factory=GpuSettings)  # type: ignore[arg-type]
    chat: ChatSettings = Field(default_factory=ChatSettings)
    # Host names accepted besides loopback names and the listen address
    allowed_hosts: list[str] = []
    http: HttpLimits = Field(default_factory=HttpLimits)  # type: ignore[arg-type]
    log_repeat_window_s: float = Field(60.0, gt=0)
    log_stream: LogStreamSettings = Field(default_factory=LogStreamSettings)  # type: ignore[arg-type]
    # Servers run under the shim (`server/shim.py`) either way. True: they outlive the daemon
    # (its stop, crash or upgrade) and its next start adopts them; false: its stop stops them.
    live_restore: bool = False
    proxy: ProxySettings | None = None  # absent: no proxy

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str]) -> list[str]:
        hosts = []
        for host in value:
            name = host.strip().strip("[]").rstrip(".").lower()
            if not name or any(c in name for c in "/@ ?#") or name.count("*") > 1:
                raise ValueError(f"not a host name: {host!r} (a name or address, no scheme)")
            if "*" in name and not (name == "*" or name.startswith("*.")):
                raise ValueError(f"a wildcard must be '*' or lead: '*.example.com', got {host!r}")
            if ":" in name:  # an IPv6 address, or a name with a port (the port is not compared)
                try:
                    ipaddress.IPv6Address(name)
                except ValueError:
                    raise ValueError(f"a host name without a port, got {host!r}") from None
            hosts.append(name)
        return hosts

    def resolve_paths(self, base: Path) -> Settings:
        def fix(p: Path) -> Path:
            return p if p.is_absolute() else (base / p).resolve()

        updates: dict[str, Any] = {
            "configs_dir": fix(self.configs_dir),
            "state_dir": fix(self.state_dir),
            "log_dir": fix(self.log_dir),
        }
        if self.token_file is not None:
            updates["token_file"] = fix(self.token_file)
        updates["compile_cache"] = self.compile_cache.model_copy(
            update={"dir": fix(self.compile_cache.dir)}
        )
        return self.model_copy(update=updates)

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return parse_listen(self.listen)


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


ENV_PREFIX = "GPUWARDEN_"


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings named by `GPUWARDEN_<KEY>` variables, nested at `__`, keys in any case
    (`GPUWARDEN_RESTART__INITIAL_DELAY_S=0` is `{"restart": {"initial_delay_s": "0"}}`). A
    value that starts like a JSON list or mapping is read as JSON (`GPUWARDEN_ALLOWED_HOSTS=
    '["gpu-box"]'`); every other value is a string, converted by the field's type. Variables
    that name no setting are ignored (`GPUWARDEN_TOKEN` is the CLI's, for one)."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.upper().startswith(ENV_PREFIX):
            continue
        keys = name[len(ENV_PREFIX) :].lower().split("__")
        if not all(keys) or keys[0] not in Settings.model_fields:
            continue
        parsed: Any = value
        if value.lstrip()[:1] in ("[", "{"):
            try:
                parsed = json.loads(value)
            except ValueError:
                raise SettingsError(f"{name}: not valid JSON: {value[:80]!r}") from None
        node = out
        for key in keys[:-1]:
            child = node.get(key)
            node = node.setdefault(key, {}) if not isinstance(child, dict) else child
        node[keys[-1]] = parsed
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = (
            _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        )
    return out


def load_settings(path: Path | None, listen: str | None = None) -> Settings:
    """Read settings from `path` (optional) and the environment, which wins over the file;
    paths made absolute."""
    data: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        base = path.resolve().parent
        try:
            loaded = load_yaml(read_regular_text(path, SETTINGS_MAX_BYTES))
        except FileNotFoundError:
            raise SettingsError(f"{path}: no such file") from None
        except (yaml.YAMLError, YamlLimit) as exc:
            raise SettingsError(f"{path}: {exc}") from exc
        except OSError as exc:
            raise SettingsError(f"{path}: {exc.strerror or exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"{path}: the settings must be a mapping")
        data = loaded or {}
    data = _merged(data, env_overrides(os.environ))
    if listen is not None:
        data["listen"] = listen
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        where = str(path) if path else "settings"
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise SettingsError(f"{where}: {problems}") from None
    return settings.resolve_paths(base)
