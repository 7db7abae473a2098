"""What a server config may say: the keys of ``configs/NAME.yaml`` and how ``args`` become argv.

``args`` become flags: ``key: value`` → ``--key value``; ``true`` → ``--key``; ``false``/``null``
→ omitted; ``0`` and ``""`` are values; a list → the flag once followed by every item; a mapping
→ its JSON. Reading the files, ``extends`` and the errors that name a file and line are
``configs.py``'s.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_COMMAND = ["python", "-m", "sglang.launch_server"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HealthConfig(_Strict):
    url: str | None = None
    startup_timeout_s: float = Field(1800.0, gt=0)
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(30.0, gt=0)
    failures: int = Field(3, ge=1)
    # Ready only once the health URL's listening socket is found among the launch's processes
    # (when its host is this machine's). False for a server reached through another process
    # that holds the port: docker-proxy, a local proxy or sidecar.
    check_listener: bool = True


class PreflightConfig(_Strict):
    argv: bool = True


Scalar = str | int | float | bool | None


class ServerConfig(_Strict):
    extends: str | None = None
    command: list[str] = Field(default_factory=lambda: list(DEFAULT_COMMAND), min_length=1)
    args: dict[str, Scalar | list[Scalar] | dict[str, Any]] = Field(default_factory=dict)
    env: dict[str, str | None] = Field(default_factory=dict)  # None: unset in the server
    gpus: list[int | str] | None = None
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)  # type: ignore[arg-type]
    # SGLang's weight cache daemon as a sidecar (`weightcache.py`); the engine in client mode.
    weight_cache: bool = False

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_to_str(cls, value: Any) -> Any:
        # `NAME: null` unsets NAME (also one inherited from the daemon, or set by the config
        # this one extends); any other scalar is the string YAML spelled.
        if isinstance(value, dict):
            return {
                k: (
                    v
                    if v is None or isinstance(v, str)
                    else json.dumps(v)
                    if isinstance(v, bool)
                    else str(v)
                )
                for k, v in value.items()
            }
        return value

    @field_validator("args")
    @classmethod
    def _check_arg_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if not re.fullmatch(r"-{0,2}[A-Za-z0-9][A-Za-z0-9._-]*", key):
                raise ValueError(f"{key!r} is not a flag name")
        return value

    @model_validator(mode="after")
    def _weight_cache_is_client_mode(self) -> ServerConfig:
        mode = next((v for k, v in self.args.items() if k.lstrip("-") == "weight-cache-mode"), None)
        if self.weight_cache and mode not in (None, "client"):
            raise ValueError(
                f"weight_cache: true runs the server with --weight-cache-mode client beside "
                f"its sidecar; args sets weight-cache-mode {mode}"
            )
        return self

    def argv(self) -> list[str]:
        """The server's argv: the command and args; with the weight cache, in client mode."""
        argv = build_argv(self.command, self.args)
        if self.weight_cache and not any(k.lstrip("-") == "weight-cache-mode" for k in self.args):
            argv += ["--weight-cache-mode", "client"]
        return argv


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def build_argv(command: list[str], args: dict[str, Any]) -> list[str]:
    argv = list(command)
    for key, value in args.items():
        flag = key if key.startswith("-") else f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv.append(flag)
            argv.extend(_scalar(v) for v in value)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, _scalar(value)]
    return argv
