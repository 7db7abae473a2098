"""`gpuwarden completion bash|zsh`: a completion script made from the CLI's own parser, so it
never falls behind a new command or flag.

bash: `source <(gpuwarden completion bash)` (or save it under
/etc/bash_completion.d/gpuwarden). zsh runs the same function through `bashcompinit`. Config
names after `start`, `restart`, `check` and `sweep` come from `gpuwarden configs`, asked when
completing (with the daemon's address from the environment, as for any command).
"""

from __future__ import annotations

import argparse
import shlex

CONFIG_COMMANDS = ("start", "restart", "check", "sweep")
FILE_FLAGS = ("--settings", "--token-file", "--dir")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Every option string, and those that take a value."""
    flags: list[str] = []
    valued: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        flags.extend(action.option_strings)
        if action.option_strings and action.nargs != 0:
            valued.extend(action.option_strings)
    return flags, valued


def bash_script(parser: argparse.ArgumentParser) -> str:
    subs = _subparsers(parser)
    top_flags, valued = _flags(parser)
    cases = []
    for name, sub in subs.items():
        flags, sub_valued = _flags(sub)
        valued.extend(v for v in sub_valued if v not in valued)
        nested = _subparsers(sub)
        choices = [
            str(c)
            for a in sub._actions
            if not a.option_strings and a.choices and not isinstance(a, argparse._SubParsersAction)
            for c in a.choices
        ]
        words = [*nested, *choices, *flags]
        configs = "yes" if name in CONFIG_COMMANDS else ""
        cases.append(
            f"        {shlex.quote(name)}) opts={shlex.quote(' '.join(words))}; "
            f"configs={configs} ;;"
        )
    top = " ".join([*subs, *top_flags])
    return f"""# gpuwarden completion (bash); made by `gpuwarden completion bash`
_gpuwarden() {{
    local cur prev cmd="" opts configs="" i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    case " {" ".join(FILE_FLAGS)} " in
        *" $prev "*) COMPREPLY=( $(compgen -f -- "$cur") ); return 0 ;;
    esac
    case " {" ".join(sorted(set(valued)))} " in
        *" $prev "*) COMPREPLY=(); return 0 ;;
    esac
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            -*) case " {" ".join(sorted(set(valued)))} " in
                    *" ${{COMP_WORDS[i]}} "*) ((i++)) ;;
                esac ;;
            *) cmd="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    case "$cmd" in
{chr(10).join(cases)}
        *) opts={shlex.quote(top)} ;;
    esac
    if [[ -n "$configs" && "$cur" != -* ]]; then
        opts="$opts $(gpuwarden configs 2>/dev/null | cut -d' ' -f1)"
    fi
    COMPREPLY=( $(compgen -W "$opts" -- "$cur") )
}}
complete -F _gpuwarden gpuwarden
"""


def zsh_script(parser: argparse.ArgumentParser) -> str:
    return (
        "# gpuwarden completion (zsh); made by `gpuwarden completion zsh`\n"
        "autoload -Uz bashcompinit && bashcompinit\n" + bash_script(parser)
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "completion",
        help="print a shell completion script: source <(gpuwarden completion bash)",
    )
    p.add_argument("shell", choices=("bash", "zsh"))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .cli import build_parser  # noqa: PLC0415 - the whole parser, as the user runs it

    parser = build_parser()
    print(bash_script(parser) if args.shell == "bash" else zsh_script(parser), end="")
    return 0
