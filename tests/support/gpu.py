"""A foreign process holding memory on a fake GPU (`gpuwarden fake-gpu hold`)."""

from __future__ import annotations

from pathlib import Path

from .procs import PY, Proc


def start_holder(procs: list[Proc], root: Path, gpu: int, mib: int) -> Proc:
    """A process holding `mib` MiB on fake GPU `gpu` of the folder `root`, once it says so."""
    proc = Proc(
        [
            PY,
            "-m",
            "gpuwarden.api.cli",
            "fake-gpu",
            "hold",
            "--gpu",
            str(gpu),
            "--mib",
            str(mib),
            "--dir",
            str(root),
        ]
    )
    procs.append(proc)
    proc.wait_for(rf"holds {mib} MiB on fake GPU {gpu}")
    return proc
