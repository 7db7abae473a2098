"""Config sweeps: start, follow, cancel, and the answer (table, CSV, chart)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, Field

from gpuwarden.api.files import read_file
from gpuwarden.api.models import ConfigItem, SweepId, errors
from gpuwarden.daemon.errors import CommandError
from gpuwarden.daemon.load import LoadSpec
from gpuwarden.daemon.sweep import SweepManager
from gpuwarden.daemon.sweepreport import CHARTS_EXTRA, Sweep, charts_missing

router = APIRouter(tags=["sweeps"])


class SweepBody(BaseModel):
    configs: list[ConfigItem] = Field(min_length=1, max_length=64)
    baseline: ConfigItem | None = None
    end_on: ConfigItem | None = None
    requests: int = Field(32, ge=1, le=10000)
    warmup: int = Field(2, ge=0, le=100)
    concurrency: int = Field(1, ge=1, le=256)
    max_tokens: int = Field(128, ge=1, le=32768)
    # Fixed-length answers (SGLang's benchmark does the same); false lets EOS end them early.
    ignore_eos: bool = True
    # "openai": the daemon's own streaming client; "sglang-bench": SGLang's benchmark, run
    # with the config's Python on random token ids of `input_len`.
    backend: Literal["openai", "sglang-bench"] = "openai"
    input_len: int = Field(128, ge=1, le=1_000_000)


class SweepSummary(BaseModel):
    id: str
    configs: list[str]
    state: str
    started_at: float
    ended_at: float | None
    best: str | None
    best_tok_s: float | None
    done: int
    total: int


class SweepList(BaseModel):
    sweeps: list[SweepSummary]


async def _manager(request: Request) -> SweepManager:
    """The sweeps, with those of earlier lives read back (once, on a thread: the first
    `GET /sweeps` read every record on the loop; requests that come meanwhile share that read)."""
    manager: SweepManager = request.app.state.sweeps
    reading: asyncio.Future[Any] | None = getattr(request.app.state, "sweeps_read", None)
    if reading is None or (reading.done() and (reading.cancelled() or reading.exception())):
        reading = asyncio.ensure_future(asyncio.to_thread(lambda: manager.sweeps))
        request.app.state.sweeps_read = reading
    await asyncio.shield(reading)
    return manager


async def _get(request: Request, sweep_id: str) -> Sweep:
    manager = await _manager(request)
    sweep = manager.sweeps.get(sweep_id)
    if sweep is None:
        record = manager.root / sweep_id / "result.json"
        # A record that is there but was skipped: say why rather than "unknown".
        await read_file(record, f"unknown sweep {sweep_id!r}")
        raise CommandError("not_found", f"unknown sweep {sweep_id!r}")
    return sweep


@router.post(
    "/sweeps",
    status_code=202,
    summary="Benchmark configs in turn",
    responses=errors(400, 401, 404, 409),
)
async def start_sweep(request: Request, body: SweepBody) -> dict[str, Any]:
    load = LoadSpec(
        requests=body.requests,
        warmup=body.warmup,
        concurrency=body.concurrency,
        max_tokens=body.max_tokens,
        ignore_eos=body.ignore_eos,
        backend=body.backend,
        input_len=body.input_len,
    )
    sweep = (await _manager(request)).start(body.configs, body.baseline, body.end_on, load)
    return sweep.view()


@router.get(
    "/sweeps",
    summary="Every sweep kept (this life's and earlier ones'), oldest first",
    responses=errors(401),
)
async def list_sweeps(request: Request) -> SweepList:
    return SweepList.model_validate({"sweeps": (await _manager(request)).listing()})


@router.get(
    "/sweeps/{sweep_id}",
    summary="A sweep's progress and results",
    responses=errors(400, 401, 404, 500),
)
async def get_sweep(request: Request, sweep_id: SweepId) -> dict[str, Any]:
    return (await _get(request, sweep_id)).view()


@router.delete(
    "/sweeps/{sweep_id}",
    summary="Cancel a sweep; the config serving before returns",
    responses=errors(400, 401, 404),
)
async def cancel_sweep(request: Request, sweep_id: SweepId) -> dict[str, Any]:
    return (await (await _manager(request)).cancel(sweep_id)).view()


async def _file(request: Request, sweep_id: str, name: str) -> bytes:
    path = (await _get(request, sweep_id)).folder / name
    missing = charts_missing() if name == "chart.png" else None
    try:
        return await read_file(path, f"{name} is not written yet")
    except CommandError as exc:
        if exc.error == "not_found" and missing is not None:
            raise CommandError("not_found", missing, {"extra": CHARTS_EXTRA}) from None
        raise


@router.get(
    "/sweeps/{sweep_id}/table.md",
    response_class=PlainTextResponse,
    responses={**errors(400, 401, 404, 500), 200: {"content": {"text/markdown": {}}}},
)
async def table_md(request: Request, sweep_id: SweepId) -> PlainTextResponse:
    return PlainTextResponse(
        (await _file(request, sweep_id, "table.md")).decode("utf-8", errors="replace"),
        media_type="text/markdown",
    )


@router.get(
    "/sweeps/{sweep_id}/table.csv",
    response_class=PlainTextResponse,
    responses={**errors(400, 401, 404, 500), 200: {"content": {"text/csv": {}}}},
)
async def table_csv(request: Request, sweep_id: SweepId) -> PlainTextResponse:
    return PlainTextResponse(
        (await _file(request, sweep_id, "table.csv")).decode("utf-8", errors="replace"),
        media_type="text/csv",
    )


@router.get(
    "/sweeps/{sweep_id}/chart.png",
    response_class=Response,
    responses={**errors(400, 401, 404, 500), 200: {"content": {"image/png": {}}}},
)
async def chart(request: Request, sweep_id: SweepId) -> Response:
    return Response(await _file(request, sweep_id, "chart.png"), media_type="image/png")
