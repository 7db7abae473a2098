"""Crash notifications to chat webhooks (Slack incoming-webhook JSON, or a generic JSON body).

A listener on the supervisor's events decides what is worth a message (a crash, a crash loop, a
rollback, `failed`, a recovery); a worker task delivers, off the supervision path, with
bounded retries (tenacity) and a timeout, so a dead or hanging webhook never delays anything.
During a crash loop the crashes collapse into one message, then a summary on recovery or
failure. Every delivery and failure is an event; webhook URLs (secrets) are never shown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuwarden.daemon import logsetup
from gpuwarden.daemon.chat import build_dump, save_dump
from gpuwarden.daemon.settings import Webhook

if TYPE_CHECKING:
    import httpx

    from gpuwarden.daemon.supervisor import Supervisor

log = logsetup.get_logger("gpuwarden.notify")
QUEUE = 50
TIMEOUT_S = 5.0
ATTEMPTS = 3


class Webhooks:
    def __init__(self, supervisor: Supervisor, hooks: list[Webhook]) -> None:
        self.sup = supervisor
        self.hooks = hooks
        self.queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(maxsize=QUEUE)
        self.suppressed = 0
        self.in_loop = False
        self.unhealthy_since_ready = False
        self._task: asyncio.Task[None] | None = None
        self.record: Callable[..., None] = supervisor.post_event

    def start(self) -> None:
        if self.hooks:
            self.sup.event_listeners.append(self.on_event)
            self._task = asyncio.get_running_loop().create_task(self._worker())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- what is worth a message -------------------------------------------------------------

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "exit" and event.get("reason") not in (None, "requested_stop"):
            self.unhealthy_since_ready = True
            if self.in_loop:
                self.suppressed += 1
                return
            self._enqueue(
                "crash", f"server crashed: {event.get('reason')}: {event.get('evidence')}"
            )
        elif kind == "crash_loop":
            self.in_loop = True
            self._enqueue(
                "crash_loop",
                f"crash loop: {event.get('failures')} failures in a row "
                f"({event.get('reason')}); further crashes are summarised",
            )
        elif kind == "rollback":
            self._enqueue(
                "rollback",
                f"swap to {event.get('from_config')} failed "
                f"({event.get('reason')}); rolled back to {event.get('to_config')}",
            )
        elif kind == "state" and event.get("to") == "failed":
            self._enqueue("failed", self._summary(f"server failed: {event.get('reason')}"))
            self.in_loop = False
        elif kind == "state" and event.get("to") == "ready" and self.unhealthy_since_ready:
            self.unhealthy_since_ready = False
            self._enqueue(
                "recovered", self._summary(f"server recovered: {event.get('config')} is ready")
            )
            self.in_loop = False

    def _summary(self, text: str) -> str:
        if self.suppressed:
            text += f" ({self.suppressed} more crashes were not announced one by one)"
            self.suppressed = 0
        return text

    def _enqueue(self, kind: str, text: str) -> None:
        if self.queue.full():
            self.queue.get_nowait()  # the oldest message goes: never block supervision
        self.queue.put_nowait((kind, text))

    # -- delivery --------------------------------------------------------------------------------

    async def _worker(self) -> None:
        import httpx  # noqa: PLC0415 - only a daemon with webhooks loads a client (~4 MiB)

        async with httpx.AsyncClient(trust_env=False, timeout=TIMEOUT_S) as client:
            while True:
                kind, text = await self.queue.get()
                try:
                    await self._send(client, kind, text)
                except Exception:  # a bug here must not end notifications
                    log.exception("notify.failed", notice=kind)

    async def _send(self, client: httpx.AsyncClient, kind: str, text: str) -> None:
        dump = await build_dump(self.sup, why=kind)
        head = f"gpuwarden: {text}\n{dump.head(4)}"
        try:
            saved = await asyncio.to_thread(
                save_dump, self.sup.settings.state_dir, dump, self.sup.settings.retention.dumps
            )
            head += f"\n(the whole dump: GET /dumps/{saved.stem})"
        except OSError as exc:  # the dump still goes out, whole, in the post's `dump`
            head += f"\n(this dump was not saved: {exc.strerror or exc})"
        await asyncio.gather(
            *(
                self._deliver(client, i, hook, kind=kind, text=head, dump=dump.data)
                for i, hook in enumerate(self.hooks, 1)
            )
        )

    async def _deliver(
        self,
        client: httpx.AsyncClient,
        n: int,
        hook: Webhook,
        *,
        kind: str,
        text: str,
        dump: dict[str, Any],
    ) -> None:
        body: dict[str, Any] = (
            {"text": text}
            if hook.format == "slack"
            else {"event": kind, "text": text, "dump": dump}
        )
        import httpx  # noqa: PLC0415 - loaded by _worker already
        from tenacity import (  # noqa: PLC0415
            AsyncRetrying,
            retry_if_exception_type,
            stop_after_attempt,
            wait_exponential,
        )

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(ATTEMPTS),
                wait=wait_exponential(multiplier=0.5, max=4),
                retry=retry_if_exception_type(httpx.HTTPError),
                reraise=True,
            ):
                with attempt:
                    res = await client.post(hook.url, json=body)
                    res.raise_for_status()
            self.record("notify_sent", webhook=f"#{n}", notice=kind)
        except httpx.HTTPError as exc:
            self.record(
                "notify_failed",
                webhook=f"#{n}",
                notice=kind,
                error=f"{type(exc).__name__} after {ATTEMPTS} attempts",
            )
