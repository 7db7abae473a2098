"""'server crashed': the diagnostic dump, chat replies, and crash notifications.

The dump answers what a person asks after a crash: what state the server is in, how the last
launch ended and why (its evidence line), the tail of the launch that failed, or, when there
is no log, exactly why not (it never ran: preflight refused it, the log could not be created,
the GPUs never freed, the command could not be executed), the GPUs and their holders, the last
events, and how the failed config differs from the last good one. Secrets are masked
everywhere, log lines included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwarden.daemon.gpu import render_gpu_table

from . import history, views
from .logfiles import read_tail
from .sglanglines import parse_line, strip_prefix

if TYPE_CHECKING:
    from gpuwarden.daemon.supervisor import Supervisor
    from gpuwarden.daemon.views import Snapshot

TAIL_LINES = 60
CHAT_LIMIT = 12000  # characters per chat reply (Mattermost: 16383; Slack: 3000 per block)
CHAT_TAIL_LINES = 30
CHAT_LINE = 240  # a log line in a chat reply is cut here; the saved dump keeps it whole
DUMP_LINE = 4000


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def matches_trigger(text: str, triggers: list[str]) -> str | None:
    """The trigger a message contains, case- and punctuation-insensitively."""
    words = f" {normalize(text)} "
    for trigger in triggers:
        t = normalize(trigger)
        if t and f" {t} " in words:
            return trigger
    return None


def is_error_line(line: str) -> bool:
    """A line that reports a failure, by the same reading that classifies exits: a finding of
    the log parser (exceptions, CUDA OOM, NCCL errors, watchdog timeouts, argparse errors,
    SIGQUIT, dead schedulers, ...) or a traceback's first line. Substrings would mark lines
    that merely mention such words, like SGLang's ``server_args=`` line (watchdog_timeout=300).
    """
    msg = strip_prefix(line).strip()
    return msg.startswith("Traceback (most recent call last)") or bool(parse_line(line).findings)


def mark(line: str) -> str:
    return f"{'!' if is_error_line(line) else ' '} {line}"


def _no_log_reason(last_exit: dict[str, Any] | None, launch_ran: bool) -> str | None:
    """Why the failed launch left no log to show, if it left none."""
    if last_exit is None:
        return None if launch_ran else "no launch has happened yet"
    reason, evidence = last_exit.get("reason"), last_exit.get("evidence")
    if reason == "preflight_refused":
        return f"the launch never ran: preflight refused it: {evidence}"
    if reason == "log_unwritable":
        return (
            "no log exists: the launch's log file could not be created, so the server was "
            f"killed at its start: {evidence}"
        )
    if reason == "gpu_busy":
        return f"the launch never ran: the GPUs were never freed: {evidence}"
    if reason == "exec_failed":
        return f"the server never started: {evidence} (the log holds only gpuwarden's header)"
    return None


def config_diff(sup: Supervisor, failed: str | None, good: str | None) -> list[str]:
    """`args`/`env` differences between the failed config and the last good one (masked)."""
    if not failed or not good or failed == good:
        return []
    try:
        a = sup.configs.load(good).view()["config"]
        b = sup.configs.load(failed).view()["config"]
    except Exception as exc:
        return [f"(cannot compare {failed} with {good}: {exc})"]
    out = []
    for section in ("args", "env"):
        left, right = a.get(section) or {}, b.get(section) or {}
        for key in sorted(set(left) | set(right)):
            if left.get(key) != right.get(key):
                out.append(
                    f"{section}.{key}: {left.get(key, '(unset)')!r} ({good}) -> "
                    f"{right.get(key, '(unset)')!r} ({failed})"
                )
    if a.get("command") != b.get("command"):
        out.append(f"command: {a.get('command')} -> {b.get('command')}")
    return out


@dataclass
class Dump:
    data: dict[str, Any]
    text: str
    name: str

    def head(self, lines: int = 6) -> str:
        return "\n".join(self.text.splitlines()[:lines])


async def build_dump(sup: Supervisor, why: str = "requested") -> Dump:
    """The dump now. What lives on the event loop (the status, the ring, the events) is read
    there; the files (an earlier launch's log, the configs compared) and the text are read and
    made on a thread: a config that takes seconds to fail would otherwise hold the loop."""
    st = sup.status()
    snap = sup.snapshot()
    ring = views.ring_lines(snap, TAIL_LINES)  # the ring changes under the loop: read it here
    events = sup.events.recent(10)
    return await asyncio.to_thread(
        lambda: _build_dump(sup, snap, st=st, ring=ring, events=events, why=why)
    )


def _build_dump(
    sup: Supervisor,
    snap: Snapshot,
    *,
    st: dict[str, Any],
    ring: list[str],
    events: list[dict[str, Any]],
    why: str,
) -> Dump:
    last = st.get("last_exit")
    failed_launch = (last or {}).get("launch_id")
    record = history.find(snap.history, failed_launch)
    tail: list[str] = []
    source = None
    if snap.log is not None and snap.launch_id == failed_launch:
        tail = ring
        source = str(snap.log.path)
    elif record and record.get("log_file"):
        redactor = sup.redactor_for(record)
        tail = [redactor.text(t) for t in read_tail(Path(record["log_file"]), TAIL_LINES)]
        source = record["log_file"]
    elif snap.log is not None:
        tail = ring
        source = str(snap.log.path)
    no_log = _no_log_reason(last, bool(snap.history) or snap.launch_config is not None)
    if not tail and no_log is None:
        no_log = "the log is empty"
    failed_config = (record or {}).get("config") or (st.get("rolled_back_from") or st.get("config"))
    diff = config_diff(sup, failed_config, st.get("last_good_config"))
    data = {
        "why": why,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "state": st["state"],
        "config": st["config"],
        "pid": st["pid"],
        "uptime_s": st["uptime_s"],
        "restarts": st["restarts"],
        "failures": st["failures"],
        "crash_loop": st["crash_loop"],
        "next_retry_at": st["next_retry_at"],
        "last_exit": last,
        "log_file": source,
        "log_tail": tail,
        "no_log": no_log,
        "gpus": st["gpus"],
        "events": events,
        "last_good_config": st["last_good_config"],
        "config_diff": diff,
        "unmanaged": st.get("unmanaged") or [],
        "weight_cache": sup.host.sidecar.view(),
        "proxy": st.get("proxy"),
    }
    text = render_text(data)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    reason = (last or {}).get("reason") or "status"
    return Dump(data=data, text=text, name=f"{stamp}-{reason}")


def render_text(d: dict[str, Any], tail_lines: int = TAIL_LINES, max_line: int = DUMP_LINE) -> str:
    lines = [f"gpuwarden dump ({d['why']}, {d['at']})"]
    state = d["state"] + ("  [CRASH LOOP]" if d["crash_loop"] else "")
    lines.append(
        f"state: {state}; config: {d['config']}; pid: {d['pid'] or '-'}; "
        f"uptime: {d['uptime_s'] if d['uptime_s'] is not None else '-'} s; "
        f"restarts: {d['restarts']}; failures in a row: {d['failures']}"
    )
    if d["next_retry_at"]:
        lines.append(f"next retry at {d['next_retry_at']}")
    last = d["last_exit"]
    if last:
        how = (
            f"exit code {last['code']}"
            if last.get("code") is not None
            else (f"signal {last['signal']}" if last.get("signal") else "never started")
        )
        lines.append(
            f"last exit: {last['reason']} ({how}, launch {last.get('launch_id') or '-'}"
            f", {last.get('at')})"
        )
        lines.append(f"evidence: {last.get('evidence')}")
    else:
        lines.append("last exit: none")
    lines.append("")
    if d["no_log"]:
        lines.append(f"log: {d['no_log']}")
    if d["log_tail"]:
        lines.append(f"log tail ({d['log_file']}; ! marks errors):")
        for t in d["log_tail"][-tail_lines:]:
            lines.append(mark(t if len(t) <= max_line else t[:max_line] + " …"))
    lines.append("")
    lines.append("GPUs:")
    lines.append(render_gpu_table(d["gpus"]) if d["gpus"] else "(no GPU information)")
    wc = d.get("weight_cache")
    if wc:  # ours, kept on purpose: its memory is the weights the next launch maps
        lines.append(
            f"weight cache sidecar: pid {wc.get('pid')} ({wc.get('state')}; fingerprint "
            f"{wc.get('fingerprint')}, started for {wc.get('config')}; log {wc.get('log_file')})"
        )
    proxy = d.get("proxy")
    if proxy:  # the clients: what was held, and under way, when this was written
        lines.append(
            f"proxy: {proxy.get('listen')} {proxy.get('mode')}; {proxy.get('held') or 0} held, "
            f"{proxy.get('in_flight') or 0} in flight; {proxy.get('cut') or 0} streams cut, "
            f"{proxy.get('continued') or 0} continued, {proxy.get('retried') or 0} retried"
        )
        for h in proxy.get("held_requests") or []:
            lines.append(f"  held: {h.get('what')} ({h.get('held_s')} s, {h.get('bytes')} bytes)")
    for u in d.get("unmanaged") or []:  # found at the boot, not verifiably ours: left alone
        lines.append(f"unmanaged: pid {u.get('pid')} ({u.get('name') or '?'}): {u.get('why')}")
    if d["config_diff"]:
        lines.append("")
        lines.append(f"config changes against the last good config ({d['last_good_config']}):")
        lines += [f"  {x}" for x in d["config_diff"]]
    lines.append("")
    lines.append("recent events:")
    for e in d["events"]:
        rest = {
            k: v for k, v in e.items() if k not in ("seq", "ts", "event", "config", "launch_id")
        }
        lines.append(
            f"  {str(e.get('ts', ''))[11:23]} {e['event']} "
            + " ".join(f"{k}={v}" for k, v in rest.items())[:160]
        )
    return "\n".join(lines)


def save_dump(state_dir: Path, dump: Dump, keep: int | None = None) -> Path:
    """Save the dump (`NAME.txt` and `NAME.json` in state_dir/dumps); with `keep`, only the
    newest `keep` saved dumps stay (the one just saved always does). Each dump gets a name of
    its own: dumps made in the same second are `NAME`, `NAME-2`, ..., each claimed with
    O_EXCL, so concurrent saves never overwrite one another. OSError when it cannot be saved;
    nothing half-written is left then."""
    folder = state_dir / "dumps"
    folder.mkdir(parents=True, exist_ok=True)
    path = _claim(folder, dump.name)
    try:
        with path.open("w") as f:
            f.write(dump.text + "\n")
        path.with_suffix(".json").write_text(json.dumps(dump.data, indent=1, default=str))
    except BaseException:
        for part in (path, path.with_suffix(".json")):
            with contextlib.suppress(OSError):
                part.unlink()
        raise
    if keep is not None:
        prune_dumps(folder, keep, path)
    return path


def _claim(folder: Path, name: str) -> Path:
    """A new, empty `folder/NAME[-N].txt` that no other save can have claimed."""
    n = 1
    while True:
        path = folder / (f"{name}.txt" if n == 1 else f"{name}-{n}.txt")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            n += 1
            continue
        return path


def prune_dumps(folder: Path, keep: int, current: Path | None = None) -> list[str]:
    """Remove all but the newest `keep` saved dumps (by time written, then name), never
    `current`; the names removed."""
    dated = []
    for txt in folder.glob("*.txt"):
        with contextlib.suppress(FileNotFoundError):
            dated.append((txt.stat().st_mtime_ns, len(txt.name), txt.name, txt))
    dated.sort()
    old = [p for *_, p in dated[: max(0, len(dated) - keep)] if p != current]
    for txt in old:
        for path in (txt, txt.with_suffix(".json")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return [p.stem for p in old]


def chat_text(dump: Dump, saved: Path | None, unsaved: str | None = None) -> str:
    """The dump sized for chat (the last lines, each cut short), with a note naming the saved
    dump when anything was cut; when it could not be saved, a note that says so and why."""
    text = render_text(dump.data, tail_lines=CHAT_TAIL_LINES, max_line=CHAT_LINE)
    if saved is None:
        note = f"\n(this dump was not saved: {unsaved or 'unknown error'})"
        if len(text) + len(note) <= CHAT_LIMIT:
            return text + note
        return text[: CHAT_LIMIT - len(note) - 2] + "\n…" + note
    ref = f"\n(the whole dump: GET /dumps/{saved.stem})"
    if len(text) + len(ref) <= CHAT_LIMIT:
        return text + (ref if text != dump.text else "")
    note = f"\n… cut to fit the chat; the whole dump: GET /dumps/{saved.stem}"
    return text[: CHAT_LIMIT - len(note)] + note


def slack_reply(text: str) -> dict[str, Any]:
    return {
        "response_type": "in_channel",
        "text": text.splitlines()[0] if text else "",
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"```{chunk}```"}}
            for chunk in _chunks(text, 2900)
        ],
    }


def _chunks(text: str, size: int) -> list[str]:
    out, cur = [], ""
    for line in text.splitlines():
        if len(cur) + len(line) + 1 > size and cur:
            out.append(cur)
            cur = ""
        cur += line[:size] + "\n"
    if cur:
        out.append(cur)
    return out


HELP = (
    "I answer {triggers} with a diagnostic dump of the SGLang server: its state, how the last "
    "launch ended and why, its log tail, GPU memory and recent events."
)
