"""Regenerate the stand-in's option table from SGLang's own ``--help`` output.

    python -m gpuwarden.standin.table sglang-0.5.23-help.txt standin/data/options-0.5.23.json

The table (names, aliases, nargs, choices, metavars) is a fact about SGLang's CLI; the help
text is its source.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .argspec import KIND_HELP, parse_help


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m gpuwarden.standin.table HELP.txt OUT.json", file=sys.stderr)
        return 2
    specs = [s for s in parse_help(Path(args[0]).read_text()) if s.kind != KIND_HELP]
    out = {"source": Path(args[0]).name, "options": [s.to_json() for s in specs]}
    Path(args[1]).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(specs)} options written to {args[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
