"""The CLI commands that keep watching: `restart --wait` with its progress, `events -f`.

`restart --wait` sends `POST /restart?wait=true` (the daemon answers once the restart has
settled, and by default once a swapped-in config has passed its probation) and, while that
request is pending, polls `/status` and the log's tail to show the state, the time waited,
the phase of the start with its ETA and the latest log line: rewritten in place on a terminal,
a plain line per change otherwise, both on stderr so that stdout keeps only the outcome.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import IO, Any

from . import render
from .target import ClientError, call

POLL_S = 0.5
EVENTS_PAGE = 500


class Progress:
    """One line rewritten in place on a terminal; otherwise a line per change of what it
    shows apart from the clock and the log line."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = _isatty(stream)
        self.last_key: tuple[Any, ...] | None = None
        self.drawn = False

    def show(self, key: tuple[Any, ...], text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + render.fit(text))
            self.drawn = True
        elif key != self.last_key:
            self.stream.write(text + "\n")
        self.last_key = key
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except ValueError:
        return False


def _progress_line(
    args: argparse.Namespace, elapsed: float, probation: bool
) -> tuple[tuple[Any, ...], str] | None:
    try:
        st = call(args, "GET", "/status", timeout=5).json()
        lines = call(args, "GET", "/logs", params={"lines": 5}, timeout=5).json()["lines"]
    except (ClientError, ValueError, KeyError):
        return None  # the daemon is busy or restarting: the answer itself still comes
    state = st.get("state") or "?"
    swap = st.get("swap") or {}
    parts = [f"[{render.duration(elapsed)}]", state]
    if swap.get("phase") and swap.get("phase") != state:
        parts.append(f"swap {swap['phase']}")
    prewarm = (
        render.prewarm_text(swap.get("prewarm")) if swap.get("phase") == "prewarming" else None
    )
    if prewarm:
        parts.append(prewarm)
    phase = st.get("phase") if state == "starting" else None
    if phase:
        parts.append(render.phase_text(phase) or "")
    if state == "ready" and probation:
        parts.append("on probation")
    latest = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    key = (state, swap.get("phase"), phase and phase.get("name"))
    return key, " · ".join(parts) + (f" · {latest}" if latest else "")


def restart_waiting(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    """`POST /restart?wait=true`, with progress on stderr while it is pending."""
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            answer["data"] = call(args, "POST", "/restart", params=params, timeout=None).json()
        except (ClientError, ValueError) as exc:
            answer["error"] = exc

    sender = threading.Thread(target=send, name="restart", daemon=True)
    t0 = time.monotonic()
    sender.start()
    progress = None if args.json else Progress(sys.stderr)
    probation = params.get("probation") == "true"
    try:
        while True:
            sender.join(POLL_S)
            if not sender.is_alive() or progress is None:
                if progress is None:
                    sender.join()
                break
            shown = _progress_line(args, time.monotonic() - t0, probation)
            if shown is not None and sender.is_alive():
                progress.show(*shown)
    except KeyboardInterrupt:
        if progress is not None:
            progress.close()
        print(
            "gpuwarden: stopped waiting; the restart goes on in the daemon "
            "(gpuwarden status, gpuwarden events -f)",
            file=sys.stderr,
        )
        raise
    if progress is not None:
        progress.close()
    error = answer.get("error")
    if isinstance(error, ClientError):
        raise error
    if error is not None:
        raise ClientError(f"POST /restart: the answer is not JSON: {error}")
    data: dict[str, Any] = answer["data"]
    data["elapsed_s"] = round(time.monotonic() - t0, 3)
    return data


def event_row(e: dict[str, Any]) -> tuple[str, str, str, str]:
    rest = {k: v for k, v in e.items() if k not in ("seq", "ts", "event", "config", "launch_id")}
    summary = " ".join(f"{k}={v}" for k, v in rest.items())
    return (
        str(e.get("ts", ""))[11:23],
        render.safe(str(e["event"])),
        render.safe(str(e.get("config") or "")),
        render.safe(summary[:110]),
    )


def follow_events(args: argparse.Namespace, shown: list[dict[str, Any]]) -> int:
    """After the events already printed, print each new one as it is recorded, until Ctrl-C.
    The cursor is the last event's `seq` (`GET /events?after=SEQ`)."""
    cursor = max((int(e.get("seq", 0) or 0) for e in shown), default=0)
    try:
        while True:
            page = call(
                args, "GET", "/events", params={"after": cursor, "limit": EVENTS_PAGE}
            ).json()["events"]
            for e in page:
                cursor = max(cursor, int(e.get("seq", 0) or 0))
                if args.json:
                    import json  # noqa: PLC0415

                    print(json.dumps(e, default=str), flush=True)
                else:
                    print("  ".join(event_row(e)).rstrip(), flush=True)
            if len(page) < EVENTS_PAGE:
                time.sleep(POLL_S)  # the next poll: nothing announces a new event to a client
    except KeyboardInterrupt:
        return 0
