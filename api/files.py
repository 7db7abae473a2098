"""The files a route answers with (saved dumps, a sweep's tables and chart): read off the event
loop, through the bounded reader that refuses anything but a regular file.

`GET /dumps/NAME` read whatever was there on the loop: a FIFO put in a dump's place froze the
daemon (an open that waits for a writer), and a 512 MiB file took it to 1.6 GB. Now a FIFO or a
device is refused without waiting, a file over the limit without reading it, each with a 500
`unreadable` that names the file and why.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuwarden.daemon import errors
from gpuwarden.daemon.errors import CommandError
from gpuwarden.daemon.safefile import read_regular

# A dump is tens of KiB, a sweep's table a few KiB, its chart a few hundred: far below this.
ROUTE_FILE_MAX_BYTES = 16 * 1024 * 1024


async def read_file(path: Path, missing: str, limit: int = ROUTE_FILE_MAX_BYTES) -> bytes:
    """The file's bytes; 404 with `missing` when it is not there, 500 when it cannot be read."""
    try:
        return await asyncio.to_thread(read_regular, path, limit)
    except FileNotFoundError:
        raise CommandError(errors.NOT_FOUND, missing) from None
    except OSError as exc:
        raise CommandError(errors.UNREADABLE, f"{path}: {exc.strerror or exc}") from None
