"""Launch logs on disk once written: reading a file's last lines, and retention.

`read_tail` serves `/logs` for an earlier launch and the crash dump; `prune_logs` keeps the
newest launches' files within the `log_retention` limits, never removing a protected one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from .launchlog import collapse_cr
from .safefile import read_regular_tail


def read_tail(path: Path, lines: int, max_bytes: int = 4 * 1024 * 1024) -> list[str]:
    """The last `lines` lines of a log file (for launches whose ring is gone), from its last
    `max_bytes`; a FIFO or a device in its place is refused, never waited on (as nothing)."""
    try:
        data = read_regular_tail(path, max_bytes)
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    return [collapse_cr(t) for t in text[-lines:]] if lines > 0 else []


# -- retention ------------------------------------------------------------------------------------


def prune_logs(
    log_dir: Path,
    keep_launches: int,
    max_bytes: int,
    protect: set[str],
    order: Sequence[str] = (),
) -> list[Path]:
    """Delete the oldest launch logs beyond the limits; never those named in `protect`.

    Oldest by launch order, not by the time in a launch id (the wall clock can go back, and
    the newest launches would go first): `order` lists the launches on record, oldest first;
    a log with no record (older than the record goes back, or from before a lost state file)
    is older than every recorded one, and such logs are ordered by their files' mtime."""
    rank = {launch_id: i for i, launch_id in enumerate(order)}
    files: list[tuple[tuple[int, int, str], Path, int]] = []
    for path in log_dir.glob("*/*.log"):
        with contextlib.suppress(OSError):
            st = path.stat()
            i = rank.get(path.stem)
            key = (1, i, path.stem) if i is not None else (0, st.st_mtime_ns, path.stem)
            files.append((key, path, st.st_size))
    files.sort()
    total = sum(size for _, _, size in files)
    count = len(files)
    removed: list[Path] = []
    for (*_, launch_id), path, size in files:
        if count <= keep_launches and total <= max_bytes:
            break
        if launch_id in protect:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
            count -= 1
            total -= size
    return removed
