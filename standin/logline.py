"""Log lines in SGLang's format, the one way every stand-in process writes them.

`log_line` writes ``[YYYY-mm-dd HH:MM:SS<prefix>] message`` to stderr and flushes, as SGLang's
logger does in each of its processes (a scheduler rank's prefix is `` TP<rank>`` when TP > 1);
`log` is the main process's line, with no prefix.
"""

from __future__ import annotations

import sys
import time


def log_line(prefix: str, message: str) -> None:
    """One line in SGLang's format: ``[YYYY-mm-dd HH:MM:SS<prefix>] message`` on stderr."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"[{stamp}{prefix}] {message}\n")
    sys.stderr.flush()


def log(message: str) -> None:
    log_line("", message)
