"""Config sweeps: start, follow, cancel, and the answer (table, CSV, chart)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, PlainTextResponse
from pydantic import BaseModel, Field

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


def _manager(request: Request) -> SweepManager:
    manager: SweepManager = request.app.state.sweeps
    return manager


def _get(request: Request, sweep_id: str) -> Sweep:
    sweep = _manager(request).sweeps.get(sweep_id)
    if sweep is None:
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
    sweep = _manager(request).start(body.configs, body.baseline, body.end_on, load)
    return sweep.view()


@router.get(
    "/sweeps",
    summary="Every sweep kept (this life's and earlier ones'), oldest first",
    responses=errors(401),
)
async def list_sweeps(request: Request) -> SweepList:
    return SweepList.model_validate({"sweeps": _manager(request).listing()})


@router.get(
    "/sweeps/{sweep_id}", summary="A sweep's progress and results", responses=errors(400, 401, 404)
)
async def get_sweep(request: Request, sweep_id: SweepId) -> dict[str, Any]:
    return _get(request, sweep_id).view()


@router.delete(
    "/sweeps/{sweep_id}",
    summary="Cancel a sweep; the config serving before returns",
    responses=errors(400, 401, 404),
)
async def cancel_sweep(request: Request, sweep_id: SweepId) -> dict[str, Any]:
    return (await _manager(request).cancel(sweep_id)).view()


def _file(request: Request, sweep_id: str, name: str) -> Any:
    path = _get(request, sweep_id).folder / name
    if not path.exists():
        missing = charts_missing() if name == "chart.png" else None
        if missing is not None:
            raise CommandError("not_found", missing, {"extra": CHARTS_EXTRA})
        raise CommandError("not_found", f"{name} is not written yet")
    return path


@router.get(
    "/sweeps/{sweep_id}/table.md",
    response_class=PlainTextResponse,
    responses={**errors(400, 401, 404), 200: {"content": {"text/markdown": {}}}},
)
async def table_md(request: Request, sweep_id: SweepId) -> PlainTextResponse:
    return PlainTextResponse(
        _file(request, sweep_id, "table.md").read_text(), media_type="text/markdown"
    )


@router.get(
    "/sweeps/{sweep_id}/table.csv",
    response_class=PlainTextResponse,
    responses={**errors(400, 401, 404), 200: {"content": {"text/csv": {}}}},
)
async def table_csv(request: Request, sweep_id: SweepId) -> PlainTextResponse:
    return PlainTextResponse(
        _file(request, sweep_id, "table.csv").read_text(), media_type="text/csv"
    )


@router.get(
    "/sweeps/{sweep_id}/chart.png",
    response_class=FileResponse,
    responses={**errors(400, 401, 404), 200: {"content": {"image/png": {}}}},
)
async def chart(request: Request, sweep_id: SweepId) -> FileResponse:
    return FileResponse(_file(request, sweep_id, "chart.png"), media_type="image/png")
