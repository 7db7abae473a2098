"""The fake GPU: the one module that owns its on-disk format.

A folder (``GPUWARDEN_FAKE_GPU_DIR``) holds ``gpus.json``::

    {"count": 8, "total_mib": 143771, "release_lag_s": 0, "uuids": [...]}

and one file per holder, ``holders/<pid>.json``::

    {"pid": 1234, "create_time": 1733140000.12, "gpu": 0, "mib": 40000}

Every file is written atomically (temp file + rename). A holder counts while its process is
alive and not a zombie (pid and create_time both match), and for ``release_lag_s`` after a
reader first sees it dead, which models the driver's teardown lag. The stand-in's schedulers
write holders; the daemon's fake backend and ``gpuwarden fake-gpu hold`` use the same code.

Imports stay light (stdlib and psutil): spawned scheduler processes import this.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ENV_DIR = "GPUWARDEN_FAKE_GPU_DIR"
DEFAULT_COUNT = 8
DEFAULT_TOTAL_MIB = 143771  # an H200 as NVML reports it


class FakeGpuError(Exception):
    """The fake GPU folder is missing or malformed."""


@dataclass(frozen=True)
class FakeGpuSpec:
    count: int = DEFAULT_COUNT
    total_mib: int = DEFAULT_TOTAL_MIB
    release_lag_s: float = 0.0
    uuids: tuple[str, ...] = ()

    def uuid(self, index: int) -> str:
        if index < len(self.uuids):
            return self.uuids[index]
        return f"GPU-fake-{index}"

    def all_uuids(self) -> list[str]:
        return [self.uuid(i) for i in range(self.count)]


@dataclass(frozen=True)
class Holder:
    pid: int
    create_time: float
    gpu: int
    mib: int
    name: str = ""


@dataclass
class GpuUsage:
    index: int
    uuid: str
    used_mib: int
    total_mib: int
    holders: list[Holder] = field(default_factory=list)


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def init_dir(
    root: Path,
    count: int = DEFAULT_COUNT,
    total_mib: int = DEFAULT_TOTAL_MIB,
    release_lag_s: float = 0.0,
    uuids: list[str] | None = None,
) -> Path:
    """Create (or overwrite) a fake GPU folder's ``gpus.json``."""
    data: dict[str, Any] = {"count": count, "total_mib": total_mib, "release_lag_s": release_lag_s}
    if uuids:
        data["uuids"] = list(uuids)
    _atomic_write_json(root / "gpus.json", data)
    (root / "holders").mkdir(parents=True, exist_ok=True)
    return root


def dir_from_env(environ: dict[str, str] | None = None) -> Path | None:
    value = (environ if environ is not None else os.environ).get(ENV_DIR)
    return Path(value) if value else None


def read_spec(root: Path) -> FakeGpuSpec:
    path = root / "gpus.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FakeGpuError(f"{path}: no such file (create it with a count and total_mib)") from exc
    except (OSError, ValueError) as exc:
        raise FakeGpuError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise FakeGpuError(f"{path}: expected a JSON object")
    try:
        count = int(data.get("count", DEFAULT_COUNT))
        total = int(data.get("total_mib", DEFAULT_TOTAL_MIB))
        lag = float(data.get("release_lag_s", 0.0))
        uuids = tuple(str(u) for u in data.get("uuids") or ())
    except (TypeError, ValueError) as exc:
        raise FakeGpuError(f"{path}: {exc}") from exc
    if count < 0 or total <= 0 or lag < 0:
        raise FakeGpuError(f"{path}: count, total_mib and release_lag_s must be positive")
    return FakeGpuSpec(count=count, total_mib=total, release_lag_s=lag, uuids=uuids)


def resolve_gpu(spec: FakeGpuSpec, token: str) -> int:
    """Map one CUDA_VISIBLE_DEVICES entry (an index or a UUID) to a fake GPU index."""
    token = token.strip()
    if token.isdigit():
        return int(token)
    uuids = spec.all_uuids()
    if token in uuids:
        return uuids.index(token)
    raise FakeGpuError(f"unknown GPU {token!r} (known: 0..{spec.count - 1}, {', '.join(uuids)})")


def gpu_for_rank(spec: FakeGpuSpec, rank: int, cuda_visible_devices: str | None) -> int:
    """The GPU that the scheduler of TP rank `rank` holds: CUDA_VISIBLE_DEVICES[rank], else rank."""
    if cuda_visible_devices:
        entries = [e for e in cuda_visible_devices.split(",") if e.strip()]
        if rank < len(entries):
            return resolve_gpu(spec, entries[rank])
    return rank


def process_create_time(pid: int) -> float:
    return psutil.Process(pid).create_time()


def write_holder(root: Path, gpu: int, mib: int, pid: int | None = None) -> Holder:
    """Register (or update) `pid` as holding `mib` on `gpu`."""
    pid = os.getpid() if pid is None else pid
    holder = Holder(pid=pid, create_time=process_create_time(pid), gpu=gpu, mib=int(mib))
    _atomic_write_json(
        root / "holders" / f"{pid}.json",
        {"pid": holder.pid, "create_time": holder.create_time, "gpu": gpu, "mib": holder.mib},
    )
    return holder


def remove_holder(root: Path, pid: int | None = None) -> None:
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(FileNotFoundError):
        (root / "holders" / f"{pid}.json").unlink()


def read_holders(root: Path) -> list[Holder]:
    """Every well-formed holder file, alive or not. Malformed files are skipped."""
    holders: list[Holder] = []
    folder = root / "holders"
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return holders
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            data = json.loads((folder / name).read_text())
            holders.append(
                Holder(
                    pid=int(data["pid"]),
                    create_time=float(data["create_time"]),
                    gpu=int(data["gpu"]),
                    mib=int(data["mib"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return holders


def holder_alive(holder: Holder) -> tuple[bool, str]:
    """(alive, process name). Zombies and reused pids count as dead."""
    try:
        proc = psutil.Process(holder.pid)
        if abs(proc.create_time() - holder.create_time) > 0.05:
            return False, ""
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False, ""
        return True, proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False, ""


class FakeGpuReader:
    """Reads the folder and applies the liveness and release-lag rules.

    Keeps, per holder, the monotonic time it was first seen dead, so a dead holder keeps its
    memory for ``release_lag_s`` and is then pruned (its file removed).
    """

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self._clock = clock
        self._dead_since: dict[tuple[int, float], float] = {}

    def usage(self) -> list[GpuUsage]:
        spec = read_spec(self.root)
        now = self._clock()
        gpus = [
            GpuUsage(index=i, uuid=spec.uuid(i), used_mib=0, total_mib=spec.total_mib)
            for i in range(spec.count)
        ]
        for holder in read_holders(self.root):
            key = (holder.pid, holder.create_time)
            alive, name = holder_alive(holder)
            if not alive:
                first = self._dead_since.setdefault(key, now)
                if now - first >= spec.release_lag_s:
                    self._dead_since.pop(key, None)
                    self._prune(holder)
                    continue
                name = "[released]"
            if 0 <= holder.gpu < spec.count:
                gpu = gpus[holder.gpu]
                gpu.used_mib = min(spec.total_mib, gpu.used_mib + holder.mib)
                gpu.holders.append(
                    Holder(holder.pid, holder.create_time, holder.gpu, holder.mib, name)
                )
        return gpus

    def _prune(self, holder: Holder) -> None:
        path = self.root / "holders" / f"{holder.pid}.json"
        try:
            data = json.loads(path.read_text())
            if float(data.get("create_time", -1)) == holder.create_time:
                path.unlink()
        except (OSError, ValueError):
            pass
