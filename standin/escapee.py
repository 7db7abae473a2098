"""A process that escapes its server: double-forks, leaves the session, ignores SIGTERM, and
keeps holding fake GPU memory after the server is gone (SGLANG.md §7's orphaned schedulers).

    python -m gpuwarden.standin.escapee FAKE_GPU_DIR GPU MIB PIDFILE

The launcher returns once the escapee has registered its holder, so its memory is visible by
the time the server goes on loading. The escapee keeps the inherited stdout/stderr open: a
supervisor that waits for pipe EOF instead of the exit would wait forever.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from . import fakegpu
from .childinit import set_title
from .logline import log_line


def main(argv: list[str]) -> int:
    root, gpu, mib, pidfile = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:
        os.close(write_fd)
        os.read(read_fd, 1)  # wait until the escapee holds its memory
        return 0
    os.close(read_fd)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_title("sglang::escapee")
    fakegpu.write_holder(root, gpu, mib)
    pidfile.write_text(str(os.getpid()))
    log_line(
        "", f"escapee pid={os.getpid()} holds {mib} MiB on GPU {gpu} (setsid, ignores SIGTERM)"
    )
    os.write(write_fd, b"1")
    os.close(write_fd)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
