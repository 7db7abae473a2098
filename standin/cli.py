"""The stand-in's command line: SGLang's options for a chosen version, plus ``--standin-*``.

`add_cli_args(parser, version)` plays the role of SGLang's ``ServerArgs.add_cli_args``: it adds
that version's options to an argparse parser, so that an exact preflight can be built and
tested without SGLang. 0.5.23's option set comes from SGLang's own ``--help`` (shipped as
``data/options-0.5.23.json``); the older versions carry the flags SGLANG.md documents for them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .argspec import (
    KIND_BOOL_PAIR,
    KIND_FLAG,
    KIND_STORE,
    OptionSpec,
    add_specs,
    default_dest,
)
from .faults import add_fault_args
from .versions import DEFAULT_VERSION, PROFILES, VERSIONS, Profile

# Types of the options whose values the stand-in uses (help text carries no types).
TYPES: dict[str, type] = {
    "port": int,
    "tp_size": int,
    "dp_size": int,
    "speculative_num_steps": int,
    "speculative_eagle_topk": int,
    "speculative_num_draft_tokens": int,
    "mem_fraction_static": float,
    "watchdog_timeout": float,
    "soft_watchdog_timeout": float,
    "dist_timeout": int,
    "decode_log_interval": int,
    "max_running_requests": int,
    "max_total_tokens": int,
    "context_length": int,
    "chunked_prefill_size": int,
    "cuda_graph_max_bs": int,
    "cuda_graph_max_bs_decode": int,
    "cuda_graph_max_bs_prefill": int,
    "tokenizer_worker_num": int,
    "random_seed": int,
}

DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 30000,
    "tp_size": 1,
    "dp_size": 1,
    "watchdog_timeout": 300.0,
    "decode_log_interval": 40,
    "log_level": "info",
}


def _legacy_specs(profile: Profile) -> list[OptionSpec]:
    """The flags of 0.4.10-0.5.12 as SGLANG.md §1 lists them, plus long-stable basics."""

    def opt(
        *strings: str, kind: str = KIND_STORE, choices: Sequence[str] | None = None
    ) -> OptionSpec:
        return OptionSpec(
            strings=strings,
            kind=kind,
            nargs=0 if kind == KIND_FLAG else None,
            choices=tuple(choices) if choices is not None else None,
            metavar=default_dest(strings).upper(),
            dest=default_dest(strings),
            extra={"required": True} if strings[0] == "--model-path" else {},
        )

    specs = [
        opt("--model-path", "--model"),
        opt("--tokenizer-path"),
        opt("--trust-remote-code", kind=KIND_FLAG),
        opt("--context-length"),
        opt("--host"),
        opt("--port"),
        opt("--tp-size", "--tensor-parallel-size"),
        opt("--dp-size", "--data-parallel-size"),
        opt("--mem-fraction-static"),
        opt("--max-running-requests"),
        opt("--max-total-tokens"),
        opt("--chunked-prefill-size"),
        opt("--random-seed"),
        opt("--watchdog-timeout"),
        opt("--dist-timeout"),
        opt("--log-level"),
        opt("--log-level-http"),
        opt("--enable-metrics", kind=KIND_FLAG),
        opt("--api-key"),
        opt("--served-model-name"),
        opt("--skip-server-warmup", kind=KIND_FLAG),
        opt("--decode-log-interval"),
        opt("--tokenizer-worker-num"),
        opt("--speculative-algorithm", choices=profile.spec_choices),
        opt("--speculative-draft-model-path", "--speculative-draft-model"),
        opt("--speculative-num-steps"),
        opt("--speculative-eagle-topk"),
        opt("--speculative-num-draft-tokens"),
        opt("--disable-cuda-graph", kind=KIND_FLAG),
    ]
    if profile.has_cuda_graph_max_bs:
        specs.append(opt("--cuda-graph-max-bs"))
    if profile.has_soft_watchdog:
        specs.append(opt("--soft-watchdog-timeout"))
    if profile.has_config_flag:
        specs.append(opt("--config"))
    return specs


@cache
def _table_0_5_23() -> tuple[OptionSpec, ...]:
    text = resources.files("gpuwarden.standin").joinpath("data/options-0.5.23.json").read_text()
    return tuple(OptionSpec.from_json(o) for o in json.loads(text)["options"])


def option_specs(version: str = DEFAULT_VERSION) -> list[OptionSpec]:
    """SGLang's options for `version` (without the stand-in's own)."""
    profile = PROFILES[version]
    if version == "0.5.23":
        return list(_table_0_5_23())
    return _legacy_specs(profile)


def add_cli_args(parser: argparse.ArgumentParser, version: str = DEFAULT_VERSION) -> None:
    """Add SGLang `version`'s options to `parser`, like ``ServerArgs.add_cli_args``."""
    specs = option_specs(version)
    add_specs(parser, specs, types=TYPES, defaults=DEFAULTS)
    # --model-path is required in every version (the usage line shows it unbracketed).
    for action in parser._actions:
        if action.dest == "model_path":
            action.required = True


def add_standin_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The stand-in's own flags. None of them collides with (or prefixes) an SGLang flag."""
    parser.add_argument(
        "--standin-version",
        choices=VERSIONS,
        default=DEFAULT_VERSION,
        help="SGLang version to imitate: flags, log formats, signal behaviour",
    )
    parser.add_argument(
        "--standin-time-scale",
        type=float,
        default=1.0,
        help="multiplies every simulated duration (imports, loading, capture, warmup, drain "
        "steps); token pacing is never scaled",
    )
    parser.add_argument(
        "--standin-seed", type=int, default=0, help="seed for accept lengths and token text"
    )
    parser.add_argument(
        "--standin-token-text",
        choices=("words", "pieces"),
        default="words",
        help="the text of a token: a whole word, or half of one (as a real tokenizer splits "
        "words: then words are not tokens)",
    )
    parser.add_argument(
        "--standin-stream-usage",
        choices=("asked", "never"),
        default="asked",
        help="a stream's usage chunk: when stream_options.include_usage asks, or never (as "
        "some servers)",
    )
    parser.add_argument(
        "--standin-eos-after",
        type=int,
        default=None,
        metavar="N",
        help="a completion ends at EOS after N tokens unless the request says ignore_eos",
    )
    parser.add_argument(
        "--standin-deepgemm",
        action="store_true",
        help="the model's GEMMs are DeepGEMM's: JIT-compiled at their first use (the target's "
        "graph capture) unless SGLang's DeepGEMM cache already holds them",
    )
    parser.add_argument(
        "--standin-load-shards",
        type=int,
        default=4,
        metavar="N",
        help="checkpoint shards to load, a second each (time-scaled): a bigger model",
    )
    parser.add_argument(
        "--standin-cuda-mib",
        type=int,
        default=0,
        metavar="MIB",
        help="(the weight cache daemon) each rank also holds MIB of real CUDA memory (torch)",
    )
    add_fault_args(parser)


def standin_preparser() -> argparse.ArgumentParser:
    """Reads the --standin-* flags before the (version-dependent) full parser exists."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_standin_args(pre)
    return pre


def build_parser(version: str = DEFAULT_VERSION) -> argparse.ArgumentParser:
    profile = PROFILES[version]
    parser = argparse.ArgumentParser(prog=profile.prog)
    add_cli_args(parser, version)
    add_standin_args(parser.add_argument_group("stand-in options (not SGLang's)"))
    return parser


class ConfigFileError(ValueError):
    """SGLang's ConfigArgumentMerger errors (a ValueError, exit 1)."""


def merge_config_file(argv: list[str], specs: Sequence[OptionSpec]) -> list[str]:
    """Expand ``--config file.yaml`` as SGLang's ConfigArgumentMerger does.

    Keys become ``--key``; true on a flag adds it and false omits it; lists become the flag
    followed by every item. The merged argv is config args + args before + args after, so the
    command line wins.
    """
    if "--config" not in argv:
        return argv
    indexes = [i for i, a in enumerate(argv) if a == "--config"]
    if len(indexes) > 1:
        raise ConfigFileError("Multiple config files specified! Only one allowed.")
    i = indexes[0]
    if i + 1 >= len(argv):
        raise ConfigFileError("No config file specified after --config")
    path = Path(argv[i + 1])
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigFileError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ConfigFileError(f"Config file not found: {path}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ConfigFileError("Config file must contain a dictionary at root level")
    flags = {s for spec in specs if spec.kind in (KIND_FLAG, KIND_BOOL_PAIR) for s in spec.strings}
    config_args: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if flag in flags or isinstance(value, bool):
            if value:
                config_args.append(flag)
        elif isinstance(value, list):
            config_args.append(flag)
            config_args.extend(str(v) for v in value)
        else:
            config_args.extend([flag, str(value)])
    return config_args + argv[:i] + argv[i + 2 :]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, Profile]:
    """Parse a full stand-in command line the way SGLang would (exit 2 on argparse errors)."""
    argv = list(argv)
    pre, _ = standin_preparser().parse_known_args(argv)
    profile = PROFILES[pre.standin_version]
    parser = build_parser(profile.version)
    if profile.has_config_flag:
        argv = merge_config_file(argv, option_specs(profile.version))
    return parser.parse_args(argv), profile
