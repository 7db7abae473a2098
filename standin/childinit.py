"""What a stand-in child does first, in SGLang's order: arm parent-death and take its title.

`arm_parent_death` is SGLang's kill_itself_when_parent_died() (PR_SET_PDEATHSIG with SIGKILL),
`set_title` its setproctitle call (skipped when setproctitle is not installed, as in SGLang).
Stdlib only: spawned children and the escapee import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1


def arm_parent_death() -> None:
    """SGLang's kill_itself_when_parent_died(): SIGKILL this process when its parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def set_title(title: str) -> None:
    try:
        import setproctitle  # noqa: PLC0415 - optional, as in SGLang

        setproctitle.setproctitle(title)
    except ImportError:
        pass
