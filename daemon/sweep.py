"""Config sweeps: swap to each config in turn, load it, record, move on, and return.

For each config: a swap (preflight and rollback rules as for any swap), `ready`, a load against
its OpenAI-compatible endpoint (with the config's own API key), and the server's own `Decode
batch` figures during the load window. A config that is refused or crashes (also during its
load: a request failed, or another launch serves at its end) is recorded as failed with its
reason and log reference and the sweep goes on; a config the sweep measures never becomes
last-good. At the end (or on cancel) the config that was serving before (or `end_on`) is
restored, once any swap or rollback under way has settled; `restored` says whether it serves
(false, with `restore_error`, when it does not). A daemon that dies mid-sweep starts that config
at its next boot (`boot.py`) and lists the sweep as `interrupted`. Results: `table.md`,
`table.csv`, `chart.png`, `result.json` under `state_dir/sweeps/ID/`; the sweeps of earlier
lives are read back from there on first use, and only the newest `retention.sweeps` folders are
kept (never a running sweep's).

httpx is imported where a sweep asks the server something, never when the daemon starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from gpuwarden.daemon import history, logsetup, views
from gpuwarden.daemon.errors import CommandError, config_refusal
from gpuwarden.daemon.load import AnswerError, LoadSpec, get_json, run_load
from gpuwarden.daemon.sglangbench import run_sglang_bench
from gpuwarden.daemon.states import ServerState
from gpuwarden.daemon.supervisor import Supervisor

from .sglanglines import parse_line
from .sweepreport import Sweep, read_sweeps, write_report

log = logsetup.get_logger("gpuwarden.sweep")

# The longest the restore waits for a swap or rollback under way to settle (each is bounded by
# the GPU wait and the startup timeout: this only guards against waiting for ever).
SETTLE_TIMEOUT_S = 3600.0


def flag_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The value of `flag` as an argparse parser reads `argv` (SGLang's): `--flag VALUE` or
    `--flag=VALUE`, the last one winning; None when it is absent."""
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def auth_headers(argv: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The server's API key (`--api-key`) as SGLang asks for it; never logged or recorded."""
    key = flag_value(argv, "--api-key")
    return {"Authorization": f"Bearer {key}"} if key else {}


class SweepManager:
    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor
        self._sweeps: dict[str, Sweep] | None = None  # read from state_dir/sweeps on first use
        self.active: Sweep | None = None

    @property
    def root(self) -> Path:
        return self.sup.settings.state_dir / "sweeps"

    @property
    def sweeps(self) -> dict[str, Sweep]:
        """Every sweep known, oldest first: this life's and those recorded by earlier ones."""
        if self._sweeps is None:
            self._sweeps = read_sweeps(self.root)
        return self._sweeps

    def listing(self) -> list[dict[str, Any]]:
        return [s.summary() for s in self.sweeps.values()]

    def prune(self) -> list[str]:
        """Keep the newest `retention.sweeps` sweeps, their folders with them; never a running
        one. Returns the ids removed."""
        keep = self.sup.settings.retention.sweeps
        done = [s for s in self.sweeps.values() if s.state != "running"]
        running = len(self.sweeps) - len(done)
        excess = len(done) - max(0, keep - running)
        removed = []
        for sweep in done[: max(0, excess)]:
            shutil.rmtree(sweep.folder, ignore_errors=True)
            self.sweeps.pop(sweep.id, None)
            removed.append(sweep.id)
        return removed

    def start(
        self,
        configs: list[str],
        baseline: str | None = None,
        end_on: str | None = None,
        load: LoadSpec | None = None,
    ) -> Sweep:
        if not configs:
            raise CommandError("bad_request", "a sweep needs at least one config")
        if self.active is not None and self.active.state == "running":
            raise CommandError("conflict", f"sweep {self.active.id} is under way")
        swap = self.sup.snapshot().swap
        if swap is not None:
            raise CommandError("conflict", f"swap {swap['id']} is under way")
        for name in {*configs, *(x for x in (baseline, end_on) if x)}:
            self._exists(name)
        sweep_id = time.strftime("sweep-%Y%m%dT%H%M%S", time.gmtime())
        n = 1
        while sweep_id in self.sweeps or (self.root / sweep_id).exists():
            n += 1
            sweep_id = f"{sweep_id.split('.')[0]}.{n}"
        snap = self.sup.snapshot()
        sweep = Sweep(
            id=sweep_id,
            configs=list(configs),
            baseline=baseline or configs[0],
            end_on=end_on,
            load=load or LoadSpec(),
            folder=self.root / sweep_id,
            original=snap.intent_config if snap.intent_running else None,
        )
        self.sweeps[sweep_id] = sweep
        self.active = sweep
        self.sup.sweep_began(sweep_id, restore_to=end_on or sweep.original)
        sweep.task = asyncio.get_running_loop().create_task(self._run(sweep))
        self.sup.post_event("sweep_started", sweep_id=sweep_id, configs=configs)
        return sweep

    def _exists(self, name: str) -> None:
        from gpuwarden.daemon.configs import ConfigError  # noqa: PLC0415

        try:
            self.sup.configs.path_of(name)
        except ConfigError as exc:
            raise config_refusal(exc) from exc

    async def cancel(self, sweep_id: str, restore: bool = True) -> Sweep:
        sweep = self.sweeps.get(sweep_id)
        if sweep is None:
            raise CommandError("not_found", f"unknown sweep {sweep_id!r}")
        if sweep.state == "running" and sweep.task is not None:
            sweep.state = "cancelled"
            sweep.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweep.task
            if restore:  # answered now; the sweep ends once the previous config is back
                sweep.task = asyncio.get_running_loop().create_task(self._finish(sweep, True))
            else:  # a stop: it ends now, restoring nothing
                await self._finish(sweep, False)
        return sweep

    def running_view(self) -> dict[str, Any] | None:
        """The sweep under way, as `/status` shows its progress (None: none runs)."""
        return self.active.view() if self.active is not None else None

    async def cancel_for_stop(self) -> None:
        """`stop` wins: the running sweep ends without restoring anything."""
        if self.active is not None and self.active.state == "running":
            await self.cancel(self.active.id, restore=False)

    # -- the run ----------------------------------------------------------------------------

    async def _run(self, sweep: Sweep) -> None:
        sup = self.sup
        try:
            await asyncio.to_thread(write_report, sweep, sup.configs, False)
            for name in sweep.configs:
                sweep.current = name
                sup.post_event(
                    "sweep_progress",
                    sweep_id=sweep.id,
                    config=name,
                    done=len(sweep.rows),
                    total=len(sweep.configs),
                )
                sweep.rows.append(await self._one(sweep, name))
                # The record so far: a daemon that dies now still lists it (as interrupted).
                await asyncio.to_thread(write_report, sweep, sup.configs, False)
            sweep.state = "done"
        except asyncio.CancelledError:
            sweep.state = "cancelled"
            raise
        except Exception as exc:
            sweep.state = "failed"
            log.exception("sweep.failed", sweep_id=sweep.id)
            sweep.rows.append({"config": sweep.current, "status": "error", "reason": repr(exc)})
        finally:
            sweep.current = None
            if sweep.state != "cancelled":  # a cancel ends it itself (`cancel`)
                await self._finish(sweep, restore=True)

    async def _finish(self, sweep: Sweep, restore: bool) -> None:
        """The end of a sweep, however it ended: its record, the previous config back (with
        `restore`), `ended_at`, the event. Never raises: the sweep ends, and says how."""
        sup = self.sup
        try:
            await self._write(sweep)
            if restore:
                await self._restore(sweep)
        except Exception as exc:  # a bug: the sweep still ends, saying the restore's fate
            log.exception("sweep.finish_failed", sweep_id=sweep.id)
            if restore and not sweep.restored:
                sweep.restored = False
                sweep.restore_error = f"the restore failed: {exc!r}"
        finally:
            sweep.ended_at = time.time()  # the sweep's whole answer is in (restore included)
            await self._write(sweep)
            with contextlib.suppress(OSError):
                removed = await asyncio.to_thread(self.prune)
                if removed:
                    sup.post_event("sweeps_pruned", sweep_ids=removed)
            sup.post_event(
                "sweep_finished",
                sweep_id=sweep.id,
                state=sweep.state,
                winner=sweep.winner,
                restored=sweep.restored,
            )
            if self.active is sweep:
                self.active = None
                sup.sweep_ended(sweep.id)

    async def _write(self, sweep: Sweep) -> None:
        """Its files, as far as the disk lets: a full disk must not keep the sweep from ending
        (the restore, `ended_at`, the event)."""
        try:
            await asyncio.to_thread(write_report, sweep, self.sup.configs)
        except OSError as exc:
            log.error("sweep.write_failed", sweep_id=sweep.id, error=str(exc))

    async def _one(self, sweep: Sweep, name: str) -> dict[str, Any]:
        sup = self.sup
        row: dict[str, Any] = {"config": name}
        try:
            await self._settled()  # the previous config's rollback, if it crashed, comes first
            outcome = await sup.restart(name, wait=True, sweep_id=sweep.id, ensure=True)
            if outcome["outcome"] != "ready":
                return {
                    **row,
                    "status": outcome["outcome"],
                    "reason": outcome["reason"],
                    "evidence": outcome["evidence"],
                    # The row's own launch's log, not the rollback's that followed it.
                    "log": history.log_of(
                        sup.snapshot().history, outcome.get("launch_ids") or [], name
                    ),
                }
        except CommandError as exc:
            reason = exc.error if exc.error != "invalid_config" else "config_error"
            return {
                **row,
                "status": "refused",
                "reason": reason,
                "evidence": exc.detail,
                "problems": exc.extra.get("problems"),
            }
        cfg = sup.configs.load(name)
        base = f"http://{cfg.host}:{cfg.port}"
        measured = sup.snapshot()  # the launch measured: the same one must serve at the end
        headers = auth_headers(measured.launch_argv or cfg.argv)
        decode: list[dict[str, float]] = []

        def listener(lines: list[str]) -> None:
            for line in lines:
                if "Decode batch" in line:
                    values = parse_line(line).decode
                    if values:
                        decode.append(values)

        sup.line_listeners.add(listener)
        try:
            if sweep.load.backend == "sglang-bench":
                env = cfg.process_env(os.environ)
                key = flag_value(measured.launch_argv or cfg.argv, "--api-key")
                if key:
                    env["OPENAI_API_KEY"] = key  # the benchmark's bearer token
                result = await run_sglang_bench(
                    list(cfg.config.command),
                    env,
                    base,
                    sweep.load,
                    output=sweep.folder / f"{name}.bench.jsonl",
                )
            else:
                result = await run_load(base, sweep.load, headers=headers)
        except Exception as exc:  # a bug in the load: this row fails, the sweep goes on
            log.exception("sweep.load_error", sweep_id=sweep.id, config=name)
            result = {
                "requests_ok": 0,
                "requests_failed": sweep.load.requests,
                "errors": [],
                "error": f"the load failed: {exc!r}",
                "tok_s": None,
            }
        finally:
            sup.line_listeners.discard(listener)
        info_accept = await _server_accept_length(base, headers)
        gen = [d["gen_throughput_tok_s"] for d in decode if "gen_throughput_tok_s" in d]
        acc = [d["accept_len"] for d in decode if "accept_len" in d]
        why, evidence = _verdict(result, measured, sup.snapshot())
        return {
            **row,
            "status": "ok" if why is None else "failed",
            "reason": why,
            "evidence": evidence,
            **result,
            "server_gen_tok_s": statistics.median(gen) if gen else None,
            "server_accept_len": statistics.fmean(acc) if acc else None,
            "avg_spec_accept_length": info_accept,
            "launch_id": measured.launch_id,
            "startup": views.startup_of(sup.snapshot().history, measured.launch_id),
        }

    async def _settled(self) -> None:
        """Until no swap is under way (a rollback the machine began on its own included)."""
        await self.sup.wait_for(lambda s: s.snapshot().swap is None, SETTLE_TIMEOUT_S)

    async def _restore(self, sweep: Sweep) -> None:
        """The config the sweep ends on serves again, or the record says why not. A swap or
        rollback under way (the last config crashed) settles first: until then a restart is
        refused, and what serves is not known."""
        target = sweep.end_on or sweep.original
        if not target:
            return
        why: str | None = None
        try:
            await self._settled()
            outcome = await self.sup.restart(target, wait=True, sweep_id=sweep.id, ensure=True)
        except CommandError as exc:
            why = f"{exc.error}: {exc.detail}"
        except TimeoutError:
            why = f"a swap under way did not settle within {SETTLE_TIMEOUT_S:g} s"
        else:
            snap = self.sup.snapshot()
            if outcome["outcome"] != "ready":
                why = f"{outcome['outcome']}: {outcome['reason']}: {outcome['evidence']}"
            elif snap.state != ServerState.READY or snap.current_config != target:
                why = f"{snap.current_config} is {snap.state} instead"
        if why is None:
            sweep.restored = target
            self.sup.post_event("sweep_restored", sweep_id=sweep.id, config=target)
            return
        sweep.restored = False
        sweep.restore_error = f"{target} is not serving: {why}"
        log.error("sweep.restore_failed", sweep_id=sweep.id, config=target, error=why)
        self.sup.post_event(
            "sweep_restore_failed", sweep_id=sweep.id, config=target, error=sweep.restore_error
        )


def _verdict(result: dict[str, Any], measured: Any, after: Any) -> tuple[str | None, str | None]:
    """(reason, evidence) when the row's figures cannot stand (None, None when they can): the
    server measured crashed or was replaced during the load (another launch, or none, serves
    at its end), a request failed, or the load itself gave no figures."""
    errors = result.get("error") or "; ".join(result.get("errors") or [])
    failed = int(result.get("requests_failed") or 0)
    if after.launch_id != measured.launch_id or after.state != ServerState.READY:
        last = after.last_exit or {}
        exit_note = (
            f"; its exit: {last.get('reason')}: {last.get('evidence')}"
            if last.get("launch_id") == measured.launch_id
            else ""
        )
        now = f"launch {after.launch_id} ({after.state})" if after.launch_id else str(after.state)
        evidence = f"launch {measured.launch_id} did not serve the whole load (now {now})"
        evidence += exit_note
        if failed:
            evidence += f"; {failed} requests failed: {errors}"
        return "server_crashed", evidence
    if failed or not result.get("requests_ok") or result.get("error"):
        return "load_failed", f"{failed} requests failed: {errors}" if failed else errors
    return None, None


async def _server_accept_length(base: str, headers: dict[str, str]) -> float | None:
    """SGLang's own average accept length (`/get_server_info`), when the server has one."""
    import httpx  # noqa: PLC0415 - only a sweep asks

    with contextlib.suppress(
        httpx.HTTPError, AnswerError, ValueError, KeyError, IndexError, TypeError, AttributeError
    ):
        async with httpx.AsyncClient(trust_env=False, timeout=10, headers=headers) as c:
            info = await get_json(c, base + "/get_server_info")
            value = info["internal_states"][0].get("avg_spec_accept_length")
            return float(value) if value is not None else None
    return None
