"""The shim's own figures (`daemon/server/shim.py`): its resident memory idle and with a server,
the capture of a flood through it against the floor (the writer to a file itself), the longest
single write the server made while its client did not read, and while no client was connected at
all (the daemon down), and the time for a later client to connect, list and attach (the shim's
share of an adoption).

Usage: python bench/shim.py [--lines N] [--reps R] [--stall-s S] [--down-s S]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuwarden.daemon.server import shimstart, shimwire

# N 80-byte lines through a 64 KiB buffer; its wall time, and its longest single write, to a file.
WRITER = """
import sys, time
n, wall_file = int(sys.argv[1]), sys.argv[2]
line = b"x" * 79 + b"\\n"
buf, longest, out = bytearray(), 0.0, open(1, "wb", buffering=0, closefd=False)
t0 = time.perf_counter()
for _ in range(n):
    buf += line
    if len(buf) >= 1 << 16:
        s = time.perf_counter()
        out.write(buf)
        longest = max(longest, time.perf_counter() - s)
        buf.clear()
if buf:
    out.write(buf)
wall = time.perf_counter() - t0
open(wall_file, "w").write(f"{wall:.6f} {longest:.6f}")
"""


# A steady writer: `rate` bytes a second in 80-byte lines, a write every 10 ms, for `secs`; its
# longest single write, to a file.
STEADY = """
import sys, time
rate, secs, out_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
per_tick = max(1, rate // 100 // 80)
chunk = (b"y" * 79 + b"\\n") * per_tick
longest, t0, tick = 0.0, time.perf_counter(), 0
while time.perf_counter() - t0 < secs:
    s = time.perf_counter()
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
    longest = max(longest, time.perf_counter() - s)
    tick += 1
    time.sleep(max(0.0, t0 + tick * 0.01 - time.perf_counter()))
open(out_file, "w").write(f"{longest:.6f} {tick * per_tick}")
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Client:
    def __init__(self, folder: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(folder / "shim.sock"))
        self.reader, self.frames, self.req = shimwire.Reader(), [], 0

    def frame(self) -> tuple[int, Any]:
        while not self.frames:
            self.frames += self.reader.feed(self.sock.recv(1 << 20))
        return self.frames.pop(0)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self.req += 1
        self.sock.sendall(shimwire.json_frame({"op": op, "req": self.req, **fields}))
        while True:
            kind, body = self.frame()
            if kind == shimwire.JSON and body.get("req") == self.req:
                return body

    def until_exit(self) -> None:
        while True:
            kind, body = self.frame()
            if kind == shimwire.JSON and body.get("event") == "exit":
                return


def start_shim(folder: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(  # as the daemon starts it: its command and its environment
        shimstart.command(folder),
        stdout=subprocess.PIPE,
        start_new_session=True,
        env=shimstart.environment(),
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"listening")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stall-s", type=float, default=30.0, help="the stalled daemon's 1 MB/s run")
    ap.add_argument("--down-s", type=float, default=60.0, help="the 1 MB/s run with no daemon")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc = start_shim(tmp / "shim")
        client = Client(tmp / "shim")
        client.request("hello")
        idle = rss_mib(proc.pid)
        floor, shim_wall, longest, stalled = [], [], [], []
        for rep in range(args.reps):
            wall_file = tmp / f"wall{rep}"
            with (tmp / f"direct{rep}.out").open("wb") as f:
                subprocess.run(
                    [sys.executable, "-c", WRITER, str(args.lines), str(wall_file)],
                    stdout=f,
                    check=True,
                )
            floor.append(float(wall_file.read_text().split()[0]))
            for stall in (False, True):
                lid = f"L{rep}{'s' if stall else ''}"
                spawn = client.request(
                    "spawn",
                    launch_id=lid,
                    argv=[sys.executable, "-c", WRITER, str(args.lines), str(wall_file)],
                    env=dict(os.environ),
                    log=str(tmp / "logs" / f"{lid}.log"),
                    head="",
                )
                assert "pid" in spawn, spawn
                if stall:  # a second client attached, which reads nothing
                    Client(tmp / "shim").request("attach", launch_id=lid)
                client.until_exit()
                wall, worst = (float(x) for x in wall_file.read_text().split())
                (stalled if stall else shim_wall).append(wall)
                longest.append(worst)
                lines = (tmp / "logs" / f"{lid}.log").read_bytes().count(b"\n")
                assert lines == args.lines, (lid, lines)
                client.request("release", launch_id=lid)
        with_server = rss_mib(proc.pid)
        time.sleep(1.5)  # a quiet second: the shim gives a flood's buffers back
        settled = rss_mib(proc.pid)
        # A later client: connect, hello, list, attach to a running server.
        client.request(
            "spawn",
            launch_id="idle",
            argv=[sys.executable, "-c", "import time; time.sleep(60)"],
            env={},
            log=str(tmp / "logs" / "idle.log"),
            head="",
        )
        takes = []
        for _ in range(20):
            t0 = time.perf_counter()
            later = Client(tmp / "shim")
            later.request("hello")
            later.request("list")
            later.request("attach", launch_id="idle")
            takes.append((time.perf_counter() - t0) * 1000)
            later.sock.close()
        client.request("release", launch_id="idle")
        # A daemon stopped for --stall-s while the server writes 1 MB/s (its client reads
        # nothing), then a daemon gone for --down-s (no client at all; a later one attaches).
        steady = {}
        for kind, secs in (("stalled", args.stall_s), ("down", args.down_s)):
            steady_file = tmp / f"steady-{kind}"
            daemon = Client(tmp / "shim")
            daemon.request(
                "spawn",
                launch_id=kind,
                argv=[sys.executable, "-c", STEADY, str(1_000_000), str(secs), str(steady_file)],
                env=dict(os.environ),
                log=str(tmp / "logs" / f"{kind}.log"),
                head="",
            )
            if kind == "down":
                daemon.sock.close()  # the daemon is gone: nobody is connected the while
            while not steady_file.exists():
                time.sleep(0.2)
            time.sleep(0.2)
            if kind == "down":  # its next life attaches to what ran on
                daemon = Client(tmp / "shim")
                assert daemon.request("attach", launch_id=kind)["pid"] > 0
            worst, written = steady_file.read_text().split()
            logged = (tmp / "logs" / f"{kind}.log").read_bytes().count(b"\n")
            steady[kind] = (float(worst) * 1000, int(written), logged)
            daemon.sock.close()
        proc.kill()
        proc.wait()
    med = statistics.median
    print(
        f"shim RSS: idle {idle:.1f} MiB; right after {2 * args.reps} floods {with_server:.1f} MiB,"
        f" a quiet second later {settled:.1f} MiB"
    )
    print(
        f"capture, {args.lines:,} lines of 80 B, 64 KiB writes, child wall (median of "
        f"{args.reps}): floor {med(floor):.3f} s; through the shim {med(shim_wall):.3f} s "
        f"({med(shim_wall) / med(floor):.2f}x); with a client that does not read "
        f"{med(stalled):.3f} s ({med(stalled) / med(floor):.2f}x)"
    )
    print(f"the server's longest single write through the shim: {max(longest) * 1000:.2f} ms")
    print(f"a later client's connect, hello, list and attach: median {med(takes):.2f} ms")
    for kind, what in (
        ("stalled", f"a daemon that reads nothing for {args.stall_s:g} s"),
        ("down", f"no daemon for {args.down_s:g} s (then one attaches)"),
    ):
        worst_ms, written, logged = steady[kind]
        print(
            f"{what} while the server writes 1 MB/s: the server's longest single write "
            f"{worst_ms:.2f} ms; lines written {written:,}, in the log {logged:,}"
        )


if __name__ == "__main__":
    main()
