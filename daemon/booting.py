"""The daemon's start, as a sub-machine of the machine's: the previous life's server being
stopped (`stopping`), then the boot's config read and preflighted like any start, then over.

The machine restores the previous life's record itself and owns one `Booting` for the
sequence. Commands asked meanwhile are handled in order with it: a stop clears what the boot
was to start (the previous server still goes), a start or restart is refused while that
server is being stopped (it would race it for its port and GPUs) and, once it is carried out,
replaces the boot's start; a shutdown waits for that server to be gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import errors
from .effects import Effects
from .errors import CommandError
from .messages import PreviousServerStopped
from .model import PreviousServer


class Booting:
    def __init__(self, host: Effects, event: Callable[..., None]) -> None:
        self.host, self.event = host, event
        self.active = False  # the boot is under way (`/status`'s `booting`)
        self.config: str | None = None  # what it starts (None: nothing, or a command cleared it)
        self.rollback: str | None = None  # what a resumed swap rolls back to
        self.stopping: PreviousServer | None = None  # the previous life's server, being stopped
        # Its launch record as that life saved it: saved again until it is stopped, so a
        # daemon that dies meanwhile still finds it at its next start.
        self.stopping_record: dict[str, Any] | None = None
        self.shutdown = False  # asked during that stop: the daemon ends once it is done

    def begin(
        self,
        config: str | None,
        rollback: str | None,
        prev: PreviousServer | None,
        prev_record: dict[str, Any] | None = None,
    ) -> bool:
        """The boot starts `config` once nothing of the previous life runs. True when nothing
        does now (the machine goes on at once); else that server is being stopped, and its
        launch record (`prev_record`) stays in state.json until it is."""
        self.active, self.config, self.rollback = True, config, rollback
        if prev is None:
            return True
        self.stopping, self.stopping_record = prev, prev_record
        self.event(
            "previous_server_found",
            pid=prev.pid,
            launch_id=prev.launch_id,
            detail="a server from the daemon's previous life is still running; stopping it",
        )
        self.host.stop_previous(prev)
        return False

    def previous_stopped(self, msg: PreviousServerStopped) -> None:
        self.event("previous_server_stopped", pid=msg.previous.pid, killed=msg.killed)

    def go_on(self) -> bool:
        """Nothing of the previous life runs any more: the boot's config (unless a command
        cleared it) is read and preflighted; the boot ends when that start arrives. True when
        a shutdown asked meanwhile ends the daemon now."""
        if not self.active:
            return False
        self.stopping, self.stopping_record = None, None
        if self.shutdown:
            self._end()
            return True
        if self.config is None:
            self._end()
        else:
            self.host.boot_start(self.config, self.rollback)
        return False

    def start_arrived(self, config: str | None) -> None:
        """The boot's own start, read and preflighted: carried out unless a command asked
        during the boot replaced it."""
        if not self.active or self.stopping is not None or self.config != config:
            raise CommandError(errors.CONFLICT, "a command asked during the boot replaced it")
        self._end()

    def start_failed(self) -> None:
        """The read or preflight of the boot's start failed (its task raised)."""
        self._end()

    def refuse_while_stopping(self, what: str) -> None:
        """A start or restart asked while the previous life's server is being stopped."""
        if self.active and self.stopping is not None:
            raise CommandError(
                errors.CONFLICT,
                "the daemon is booting: it is stopping the server its previous life left "
                f"running (pid {self.stopping.pid}); {what} again once that is done",
            )

    def replaced(self) -> None:
        """A start or restart asked during the boot is carried out: the boot's start, still
        being read, is not."""
        if self.active:
            self._end()

    def stop(self) -> None:
        """A stop asked during the boot: it starts nothing (the previous server still goes)."""
        self.config = None
        if self.stopping is None:
            self._end()

    def shutdown_waits(self) -> bool:
        """A shutdown asked during the boot: True when it must wait for the previous life's
        server to be stopped (the daemon then ends in `go_on`)."""
        self.config = None
        if self.stopping is not None:
            self.shutdown = True
            return True
        self._end()
        return False

    def _end(self) -> None:
        self.active, self.config, self.rollback = False, None, None
