"""A resolved config: the server's argv, environment and address, and its secrets masked.

What one named config (`configs.ConfigStore`) resolves to, read by everything that launches,
probes or shows a server: the final argv, the environment's changes, the server's own view of
its options (``--port``, ``--host``: `option_value`), the health and metrics URLs, the GPUs to
watch, and the same with secrets masked for the API and the launch log's header.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpuwarden.standin.argspec import split_command

from .configschema import ServerConfig
from .launchsecrets import ArgvSecrets, argv_secrets, redact_env, secret_values
from .redact import MASK, Redactor, longest_first, mask_url_passwords, url_passwords

SGLANG_DEFAULT_PORT = 30000


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
    def model_path(self) -> str | None:
        """The model the server loads: its `--model-path`, or `sglang serve MODEL`'s."""
        value = self.server_option("--model-path")
        cli = split_command(self.argv)
        if value is None and cli.module == "sglang.launch_server" and cli.args[:1]:
            value = cli.args[0] if not cli.args[0].startswith("-") else None
        return value

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
        return self.server_url("/metrics")

    def server_url(self, path: str) -> str:
        """A route of the server: the health URL's scheme, host and port, and `path`."""
        parts = urlsplit(self.health_url)
        return urlunsplit((parts.scheme, parts.netloc, path, "", ""))

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


def redacted_header_lines(cfg: ResolvedConfig) -> list[str]:
    env = " ".join(f"{k}={v}" for k, v in cfg.redacted_env().items() if v is not None)
    if cfg.unset_env:
        env = f"{env}; unset: {' '.join(cfg.unset_env)}".lstrip("; ")
    return [
        f"config: {cfg.name} (hash {cfg.config_hash}; {', '.join(str(f) for f in cfg.files)})",
        f"argv: {' '.join(cfg.redacted_argv())}",
        f"env overrides: {env or '(none)'}",
    ]
