"""Preflight: will this config's server accept its argv, and can it start here?

The server's own options (``serverparser.py``: from its interpreter, exactly, or from its
``--help``) make an equivalent parser here, and the config's argv is parsed by it, abbreviations
and all, so ``--tp 2`` passes and ``--speculative-eagle-top-k 4`` fails in milliseconds instead
of after seconds of imports. A command that is neither SGLang nor the stand-in is not run: its
argv is not checked and a warning says so.

Also checked: local model and draft paths exist; the port is free or held by the server being
replaced. Every problem is reported, in SGLang's wording where SGLang has one.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.standin.argspec import add_specs, split_command

from .redact import Redactor
from .resolvedconfig import ResolvedConfig
from .serverparser import ParserSpec, ServerParsers, known_server


@dataclass
class PreflightResult:
    ok: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    method: str = ""  # "parser" (exact) | "help" | "skipped"

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "warnings": self.warnings,
            "method": self.method,
        }


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage and exit 2
        raise _ParseError(f"{self.prog}: error: {message}")


class _ParseError(Exception):
    pass


class Preflight:
    """Checks configs against their servers' parsers (built once, then cached)."""

    def __init__(self) -> None:
        self.parsers = ServerParsers()

    async def check(
        self, cfg: ResolvedConfig, replacing_port: int | None = None
    ) -> PreflightResult:
        result = PreflightResult(ok=True)
        # The default port (30000) is SGLang's: another program listens where its own flags say,
        # so the port is checked only when the config names one or the program is SGLang's.
        knows_port = cfg.server_option("--port") is not None or known_server(
            split_command(cfg.argv).module
        )
        if cfg.config.preflight.argv:
            cli = split_command(cfg.argv)
            args, unchecked = serve_args(cli.program, cli.args)
            if unchecked is not None:
                result.method = "skipped"
                result.warnings.append(unchecked)
            else:
                spec, warnings = await self.parsers.parser_for(cfg)
                result.warnings += warnings
                if spec is not None:
                    result.method = "parser" if spec.exact else "help"
                    result.problems += check_argv(spec, args)
            result.warnings += config_file_warnings(args)
        else:
            result.method = "skipped"
            result.warnings.append("preflight.argv is false: the argv was not checked")
        result.problems += check_paths(cfg)
        result.problems += check_weight_cache(cfg)
        port_problem = check_port(cfg.host, cfg.port, replacing_port) if knows_port else None
        if port_problem:
            result.problems.append(port_problem)
        # argparse quotes what it refuses (`unrecognized arguments: ... sk-...`).
        scrub = Redactor(cfg.secret_values()).text
        result.problems = [scrub(p) for p in result.problems]
        result.warnings = [scrub(w) for w in result.warnings]
        result.ok = not result.problems
        return result


def serve_args(program: Sequence[str], args: Sequence[str]) -> tuple[list[str], str | None]:
    """`sglang serve`'s argv as its LLM parser sees it, or why it cannot be checked.

    `sglang serve X ...` is `--model-path X ...`; `--model-type llm|auto` is taken out before
    parsing; another model type is served by another backend, whose options are not known."""
    out = list(args)
    if list(program[-1:]) != ["serve"]:
        return out, None
    kind = "auto"
    kept: list[str] = []
    i = 0
    while i < len(out):
        a = out[i]
        if a == "--model-type" and i + 1 < len(out):
            kind = out[i + 1]
            i += 2
            continue
        if a.startswith("--model-type="):
            kind = a.split("=", 1)[1]
        else:
            kept.append(a)
        i += 1
    if kind not in ("auto", "llm"):
        return kept, (
            f"`sglang serve --model-type {kind}` runs another backend than SGLang's language "
            "model server: its options are not known here, so the argv was not checked"
        )
    if kept and not kept[0].startswith("-"):
        kept = ["--model-path", *kept]
    return kept, None


def config_file_warnings(args: Sequence[str]) -> list[str]:
    for i, a in enumerate(args):
        if a == "--config" or a.startswith("--config="):
            name = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            return [
                f"the options in --config {name} are merged by SGLang when it starts: "
                "they were not checked"
            ]
    return []


def check_argv(spec: ParserSpec, args: list[str]) -> list[str]:
    parser = _RaisingParser(prog=spec.prog, add_help=False)
    add_specs(parser, spec.options)
    problems: list[str] = []
    try:
        _, unknown = parser.parse_known_args(args)
        if unknown:
            problems.append(f"{spec.prog}: error: unrecognized arguments: {' '.join(unknown)}")
    except _ParseError as exc:
        problems.append(str(exc))
    return problems


def _local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~"))


def check_paths(cfg: ResolvedConfig) -> list[str]:
    problems = []
    for key in (
        "model-path",
        "model",
        "speculative-draft-model-path",
        "speculative-draft-model",
        "tokenizer-path",
    ):
        value = cfg.config.args.get(key)
        if isinstance(value, str) and _local(value) and not Path(value).expanduser().exists():
            problems.append(f"--{key} {value}: no such file or directory")
    return problems


def check_weight_cache(cfg: ResolvedConfig) -> list[str]:
    """SGLang 0.5.23 refuses its weight cache beside speculative decoding."""
    if cfg.config.weight_cache and cfg.server_option("--speculative-algorithm"):
        return [
            "weight_cache: true: SGLang 0.5.23 refuses --weight-cache-mode together with "
            "speculative decoding (--speculative-algorithm)"
        ]
    return []


def check_port(host: str, port: int, replacing_port: int | None) -> str | None:
    if replacing_port == port:
        return None  # held by the server being replaced
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return (
                f"[Errno {exc.errno}] error while attempting to bind on address "
                f"('{host}', {port}): {(exc.strerror or '').lower()} "
                "(another process holds the port)"
            )
    return None
