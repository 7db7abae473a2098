"""``gpuwarden fake-gpu hold``: plant a foreign holder on the fake GPU (holds until killed).

The fake GPU module (and psutil with it) is imported when a subcommand runs, not when the
CLI builds its parser: every other command would pay for it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fake-gpu", help="the fake GPU used by the demo and the tests")
    fsub = p.add_subparsers(dest="fake_gpu_command", required=True)
    hold = fsub.add_parser("hold", help="hold fake GPU memory until killed (a foreign process)")
    hold.add_argument("--gpu", type=int, required=True, help="GPU index")
    hold.add_argument("--mib", type=int, required=True, help="memory to hold, MiB")
    # $GPUWARDEN_FAKE_GPU_DIR is fakegpu.ENV_DIR.
    hold.add_argument(
        "--dir", type=Path, default=None, help="fake GPU folder (default: $GPUWARDEN_FAKE_GPU_DIR)"
    )
    hold.set_defaults(func=run_hold)
    init = fsub.add_parser("init", help="create a fake GPU folder")
    init.add_argument("dir", type=Path)
    init.add_argument("--count", type=int, default=None)  # default: fakegpu.DEFAULT_COUNT
    init.add_argument("--total-mib", type=int, default=None)  # fakegpu.DEFAULT_TOTAL_MIB
    init.add_argument("--release-lag-s", type=float, default=0.0)
    init.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    from gpuwarden.standin import fakegpu  # noqa: PLC0415

    count = fakegpu.DEFAULT_COUNT if args.count is None else args.count
    total_mib = fakegpu.DEFAULT_TOTAL_MIB if args.total_mib is None else args.total_mib
    fakegpu.init_dir(args.dir, count, total_mib, args.release_lag_s)
    print(f"fake GPU folder {args.dir}: {count} x {total_mib} MiB")
    return 0


def run_hold(args: argparse.Namespace) -> int:
    from gpuwarden.standin import fakegpu  # noqa: PLC0415

    root = args.dir or fakegpu.dir_from_env()
    if root is None:
        print(
            f"gpuwarden: no fake GPU folder: pass --dir or set {fakegpu.ENV_DIR}", file=sys.stderr
        )
        return 2
    try:
        spec = fakegpu.read_spec(root)
    except fakegpu.FakeGpuError as exc:
        print(f"gpuwarden: {exc}", file=sys.stderr)
        return 1
    if not 0 <= args.gpu < spec.count:
        print(
            f"gpuwarden: --gpu {args.gpu}: the fake host has GPUs 0..{spec.count - 1}",
            file=sys.stderr,
        )
        return 2
    if args.mib <= 0:
        print("gpuwarden: --mib must be positive", file=sys.stderr)
        return 2

    def stop(signum: int, frame: FrameType | None) -> None:
        fakegpu.remove_holder(root)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    fakegpu.write_holder(root, args.gpu, args.mib)
    print(
        f"pid {os.getpid()} holds {args.mib} MiB on fake GPU {args.gpu}; kill it to release",
        flush=True,
    )
    while True:
        signal.pause()
