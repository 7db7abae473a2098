"""The CLI commands that talk to a running daemon over HTTP (which daemon, and the request
itself: ``target.py``).

Readable tables by default (colour on a terminal), ``--json`` for scripts. Exit codes: 0 ok,
1 failed (a one-line reason on stderr; a ``restart --wait`` that ended in a rollback is a
failure), 2 usage; ``status`` answers 3 when the server is not ``ready``, as ``systemctl
status`` does for a unit that is not active.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import follow, render
from .target import ClientError, call, connect, resolve_target
from .transport import ConnectFailed, InvalidUrl, TransportError

EXIT_NOT_READY = 3  # `status` of a server that is not ready (systemctl: unit not active)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _table(rows: Sequence[tuple[str, ...]], headers: tuple[str, ...]) -> None:
    print(render.table(rows, headers, render.colour_on(sys.stdout)))


def cmd_status(args: argparse.Namespace) -> int:
    st = call(args, "GET", "/status").json()
    code = 0 if st.get("state") == "ready" else EXIT_NOT_READY
    if args.json:
        _print_json(st)
        return code
    on = render.colour_on(sys.stdout)
    state = render.state_text(st["state"], on)
    if st.get("booting"):
        state += "  " + render.paint("(booting: restoring the previous life)", "yellow", on)
    if st.get("crash_loop"):
        state += "  " + render.paint("(crash loop)", "red", on)
    if st.get("uptime_s") is not None:
        state += f"  up {render.duration(st['uptime_s'])}"
    retry = render.seconds_until(st.get("next_retry_at"))
    if retry is not None and st["state"] == "backoff":
        state += f"  next retry in {render.duration(max(0.0, retry))}"
    last = st.get("last_exit") or {}
    last_text = "-"
    if last:
        last_text = f"{render.paint(str(last.get('reason')), 'red', on)}: {last.get('evidence')}"
        last_text += f"  ({render.ago(last.get('at'))})" if last.get("at") else ""
    rows = [
        ("state", state),
        ("config", str(st.get("config"))),
        ("pid", str(st.get("pid") or "-")),
        ("launch", str(st.get("launch_id") or "-")),
        ("started", render.ago(st.get("started_at")) if st.get("started_at") else "-"),
        ("restarts / failures", f"{st.get('restarts')} / {st.get('failures')}"),
        ("last good config", str(st.get("last_good_config") or "-")),
        ("last exit", last_text),
        ("log file", str(st.get("log_file") or "-")),
    ]
    phase = render.phase_text(st.get("phase"))
    if phase:
        rows.append(("phase", phase))
    start = render.startup_text(st.get("startup"))
    if start:
        rows.append(("start took", start))
    if st.get("swap"):
        sw = st["swap"]
        rows.append(("swap", f"{sw['id']}: {sw['from']} -> {sw['to']} ({sw['phase']})"))
        prewarm = render.prewarm_text(sw.get("prewarm"))
        if prewarm:
            rows.append(("pre-warm", prewarm.removeprefix("pre-warm ")))
    if st.get("rolled_back_from"):
        rows.append(("rolled back from", st["rolled_back_from"]))
    wc = st.get("weight_cache")
    if isinstance(wc, dict):
        rows.append(
            (
                "weight cache",
                render.safe(
                    f"pid {wc.get('pid')} {wc.get('state')} {wc.get('fingerprint')} "
                    f"(for {wc.get('config')})"
                ),
            )
        )
    if proxy := render.proxy_text(st.get("proxy")):
        rows.append(("proxy", proxy))
    metrics = st.get("server_metrics") or {}
    if metrics:
        rows.append(("server", ", ".join(f"{k}={v}" for k, v in metrics.items() if k != "at")))
    for g in st.get("gpus") or []:
        holders = ", ".join(
            f"{p['pid']}{'*' if p['ours'] else ''} {p['used_mib']} MiB" for p in g["processes"]
        )
        rows.append((f"gpu {g['index']}", f"{g['used_mib']}/{g['total_mib']} MiB  {holders}"))
    print(render.table([(render.paint(k, "bold", on), v) for k, v in rows]))
    return code


def _status_field(args: argparse.Namespace, key: str) -> Any:
    """One field of `/status`, or None where the daemon does not answer it (a progress line
    or a closing remark is no reason to fail the command)."""
    try:
        return call(args, "GET", "/status", timeout=5).json().get(key)
    except (ClientError, ValueError, AttributeError):
        return None


def _print_start(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """After a restart that reached ready: where its start went (`start took: 41.2s: ...`)."""
    if data.get("outcome") != "ready" or data.get("state") != "ready":
        return  # (a rollback's start is not the one asked for)
    start = render.startup_text(_status_field(args, "startup"))
    if start:
        print(f"start took {start}")


def cmd_restart(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"wait": "true" if args.wait else "false"}
    if args.wait:
        params["probation"] = "true" if args.probation else "false"
    if args.config:
        params["config"] = args.config
    if args.wait:
        data = follow.restart_waiting(args, params)
    else:
        data = call(args, "POST", "/restart", params=params).json()
    if args.json:
        _print_json(data)
    elif args.wait:
        took = f" after {render.duration(data['elapsed_s'])}" if "elapsed_s" in data else ""
        print(f"{data['outcome']}: {data.get('evidence') or data.get('reason') or ''}{took}")
        _print_start(args, data)
    else:
        print(f"accepted: {data.get('swap_id')} -> {data.get('config')} ({data.get('state')})")
    if args.wait and data.get("outcome") != "ready":
        why = data.get("evidence") or ""
        print(
            f"gpuwarden: restart ended {data.get('outcome')}: {data.get('reason')}"
            + (f" ({why})" if why else ""),
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    params = {"config": args.config} if args.config else {}
    data = call(args, "POST", "/start", params=params).json()
    _print_json(data) if args.json else print(f"starting {data.get('config')} ({data['state']})")
    return 0


STOP_MARGIN_S = 60.0  # beyond stop.grace_s: the SIGKILL, the sweep, the state's save
STOP_POLL_S = 0.1


def cmd_stop(args: argparse.Namespace) -> int:
    """Like `systemctl stop`, waits until the server is stopped (`--no-wait`: returns once the
    stop is accepted), so `gpuwarden stop && gpuwarden start` works."""
    data = call(args, "POST", "/stop").json()
    if args.wait:
        limit = args.timeout
        if limit is None:
            limit = float(data.get("grace_s") or 0.0) + STOP_MARGIN_S
        deadline = time.monotonic() + limit
        while data["state"] != "stopped":
            if time.monotonic() >= deadline:
                print(
                    f"gpuwarden: the server is still {data['state']} after "
                    f"{render.duration(limit)}; the stop goes on in the daemon "
                    "(gpuwarden status)",
                    file=sys.stderr,
                )
                return 1
            time.sleep(STOP_POLL_S)
            st = call(args, "GET", "/status").json()
            if (st.get("intent") or {}).get("running"):
                print(
                    f"gpuwarden: a start came after the stop: the server is {st['state']} "
                    f"(config {st.get('config')})",
                    file=sys.stderr,
                )
                return 1
            data = {**data, "state": st["state"]}
    if args.json:
        _print_json(data)
    else:
        print("stopped" if data["state"] == "stopped" else f"stopping ({data['state']})")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    if args.follow:
        return _follow(args)
    params: dict[str, Any] = {"lines": args.lines}
    if args.launch:
        params["launch"] = args.launch
    data = call(args, "GET", "/logs", params=params).json()
    if args.json:
        _print_json(data)
        return 0
    for line in data["lines"]:
        print(render.safe(line))
    if data.get("note"):
        print(f"({render.safe(data['note'])})", file=sys.stderr)
    return 0


def _follow(args: argparse.Namespace) -> int:
    try:
        with connect(args, timeout=None).stream(
            "GET", "/logs/stream", params={"history": args.lines}
        ) as res:
            if res.status_code != 200:
                raise ClientError(f"/logs/stream: {res.status_code}")
            event = "line"
            for raw in res.iter_lines():
                if raw.startswith("event: "):
                    event = raw[7:]
                elif raw.startswith("data: "):
                    text = render.safe(raw[6:])
                    print(text if event == "line" else f"({text})", flush=True)
    except ConnectFailed as exc:
        raise ClientError(f"cannot reach the daemon at {args.url}: {exc}") from exc
    except InvalidUrl as exc:
        raise ClientError(f"GET /logs/stream: {exc}") from exc
    except TransportError as exc:
        # The daemon ends a stream whose reader took nothing for log_stream.send_timeout_s,
        # and every stream when it stops.
        raise ClientError(f"the daemon ended the log stream: {exc}") from exc
    except KeyboardInterrupt:
        pass
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    data = call(args, "GET", "/events", params={"limit": args.limit}).json()
    if args.json and args.follow:  # one JSON object per line, as the follow goes on
        for e in data["events"]:
            print(json.dumps(e, default=str), flush=True)
    elif args.json:
        _print_json(data)
    else:
        _table([follow.event_row(e) for e in data["events"]], ("time", "event", "config", ""))
        sys.stdout.flush()
    if args.follow:
        return follow.follow_events(args, data["events"])
    return 0


def cmd_configs(args: argparse.Namespace) -> int:
    data = call(args, "GET", "/configs").json()
    if args.json:
        _print_json(data)
        return 0
    for name in data["configs"]:
        marks = []
        if name == data.get("current"):
            marks.append("current")
        if name == data.get("last_good"):
            marks.append("last good")
        print(name + (f"  ({', '.join(marks)})" if marks else ""))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.offline:
        import asyncio  # noqa: PLC0415 - only the offline check runs a loop

        data = asyncio.run(_check_offline(args))
    else:
        data = call(args, "POST", f"/configs/{args.config}/check", ok=(200, 422)).json()
    if args.json:
        _print_json(data)
    else:
        print(f"{args.config}: {'ok' if data['ok'] else 'refused'}")
        for problem in data.get("problems", []):
            print(f"  problem: {problem}")
        for warning in data.get("warnings", []):
            print(f"  warning: {warning}")
    return 0 if data["ok"] else 1


async def _check_offline(args: argparse.Namespace) -> dict[str, Any]:
    from gpuwarden.daemon.configs import ConfigError, ConfigStore  # noqa: PLC0415
    from gpuwarden.daemon.preflight import Preflight  # noqa: PLC0415
    from gpuwarden.daemon.settings import SettingsError, load_settings  # noqa: PLC0415

    try:
        settings = load_settings(args.settings)
        cfg = ConfigStore(settings.configs_dir).load(args.config)
    except (SettingsError, ConfigError) as exc:
        return {"ok": False, "problems": [str(exc)], "warnings": []}
    return (await Preflight().check(cfg)).to_json()


def cmd_sweep(args: argparse.Namespace) -> int:
    body = {
        "configs": args.configs,
        "baseline": args.baseline,
        "end_on": args.end_on,
        "requests": args.requests,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "backend": args.backend,
        "input_len": args.input_len,
    }
    sweep = call(args, "POST", "/sweeps", json=body).json()
    sid = sweep["id"]
    progress = None if args.json else follow.Progress(sys.stderr)
    t0 = time.monotonic()
    try:
        # Done means measured; the answer is in once the previous config is back (`ended_at`),
        # however the sweep ended.
        while sweep.get("ended_at") is None:
            time.sleep(0.5)  # nothing announces a sweep's progress to a client: it is polled
            sweep = call(args, "GET", f"/sweeps/{sid}").json()
            if progress is not None:
                current = sweep.get("current") or "finishing"
                # The config being measured may be starting: its phase and ETA.
                phase = render.phase_text(_status_field(args, "phase"))
                progress.show(
                    (sweep["done"], current, phase and phase.split(" ")[0]),
                    f"[{render.duration(time.monotonic() - t0)}] {sid}: "
                    f"{sweep['done']}/{sweep['total']} · {current}"
                    + (f" · {phase}" if phase else ""),
                )
    except KeyboardInterrupt:
        if progress is not None:
            progress.close()
        sweep = call(args, "DELETE", f"/sweeps/{sid}").json()
        print(f"cancelled {sid}; restoring {sweep.get('original')}", file=sys.stderr)
        return 1
    if progress is not None:
        progress.close()
    if args.json:
        _print_json(sweep)
    else:
        from gpuwarden.daemon.sweepreport import render_text  # noqa: PLC0415

        print(render_text(sweep))
        print(f"files: {sweep['folder']}/table.md, table.csv, result.json", end="")
        print(
            ", chart.png"
            if not sweep.get("chart_missing")
            else f"\nno chart: {sweep['chart_missing']}"
        )
    if sweep.get("restored") is False:
        # The config that served before is not back: the sweep's answer stands, but not
        # what serves now.
        print(f"gpuwarden: {sid}: not restored: {sweep.get('restore_error')}", file=sys.stderr)
        return 1
    return 0 if sweep["state"] == "done" else 1


def cmd_dump(args: argparse.Namespace) -> int:
    headers = {"Accept": "application/json"} if args.json else {}
    res = call(args, "GET", "/dump", headers=headers)
    if args.json:
        _print_json(res.json())  # re-encoded: C1 controls come raw in the daemon's JSON
    else:
        print("\n".join(render.safe(line) for line in res.text.rstrip("\n").split("\n")))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.command != "check" or not args.offline:
            resolve_target(args)
        return int(COMMANDS[args.command](args))
    except ClientError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1


COMMANDS = {
    "status": cmd_status,
    "restart": cmd_restart,
    "start": cmd_start,
    "stop": cmd_stop,
    "logs": cmd_logs,
    "events": cmd_events,
    "configs": cmd_configs,
    "check": cmd_check,
    "sweep": cmd_sweep,
    "dump": cmd_dump,
}
