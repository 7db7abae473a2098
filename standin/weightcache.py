"""SGLang 0.5.23's weight cache daemon, and its engine's client side, as the stand-in plays them.

`python -m gpuwarden.standin.weightcache <sglang serve flags>` is the launcher
(`sglang.srt.weight_cache.daemon`): one child per TP rank (`--tp-rank R --gpu-id G`), each of
which loads the weights from "disk" (the shards' time, time-scaled), holds their fake GPU
memory, listens on a Unix socket per GPU and writes a ready file beside it
(`SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE` / `..._READY_TEMPLATE`, `{device_uuid}` in them). The
launcher says when all are ready; SIGINT to it stops them (SIGTERM, then SIGKILL); each child
dies with it. Requests are SGLang's: a 4-byte big-endian length, then a pickle of builtins
(`ping`, `fetch_state` with the engine's fingerprint: `ok` or `mismatch`).

`fetch` is the engine's side (`--weight-cache-mode client`): no socket, a full load (SGLang's
fallback); a socket nobody answers, or another fingerprint, an error as in SGLang.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import fakegpu
from .cli import parse  # (the engine's parser: the daemon takes `sglang serve` flags)
from .logline import log

SOCKET_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.sock"
READY_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.ready"
WEIGHTS_FRACTION = 0.30  # of a GPU, as the engine's own load holds (`rankload.py`)


def paths(uuid: str, environ: dict[str, str] | os._Environ[str]) -> tuple[Path, Path]:
    """The socket and ready file of the GPU `uuid` (SGLang's device UUID: no `GPU-`)."""
    device = uuid.removeprefix("GPU-")
    sock = environ.get("SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE") or SOCKET_TEMPLATE
    ready = environ.get("SGLANG_WEIGHT_CACHE_READY_TEMPLATE") or READY_TEMPLATE
    return Path(sock.format(device_uuid=device)), Path(ready.format(device_uuid=device))


def fingerprint(args: Any, tp_rank: int) -> dict[str, Any]:
    """What must match between the daemon's weights and an engine's rank (SGLang's
    `CacheConfig`, the fields the stand-in has)."""
    return {
        "model_path": args.model_path,
        "tp_size": int(args.tp_size or 1),
        "tp_rank": tp_rank,
        "dtype": str(getattr(args, "dtype", None) or "auto"),
        "quantization": getattr(args, "quantization", None),
        "revision": getattr(args, "revision", None) or "",
    }


def _send(conn: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket) -> Any:
    head = b""
    while len(head) < 4:
        chunk = conn.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        head += chunk
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return pickle.loads(data)


# -- the engine's side --------------------------------------------------------------------------


def fetch(sock: Path, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The daemon's answer for `wanted`: its reply (`ok`), or None where there is no daemon
    (the engine then loads from disk). Raises as SGLang does otherwise."""
    if not sock.exists():
        log(f"[IpcModelLoader] Daemon socket not found at {sock}.")
        log(
            "[IpcModelLoader] Weight cache not available or config mismatch, falling back to "
            "disk load"
        )
        return None
    log(f"[IpcModelLoader] Requesting weights from daemon at {sock} with config: {wanted}")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(str(sock))
    except OSError as exc:
        raise RuntimeError(
            f"[IpcModelLoader] Daemon socket exists at {sock} but refused the connection. "
            "Is the weight cache daemon still running?"
        ) from exc
    with conn:
        _send(conn, {"type": "fetch_state", "config": wanted})
        reply = _recv(conn)
    if reply.get("status") != "ok":
        raise RuntimeError(
            f"[IpcModelLoader] Daemon config mismatch!\n  Engine config: {wanted}\n"
            f"  Daemon config: {reply.get('daemon_config')}"
        )
    return dict(reply)


# -- the daemon ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve_rank(args: Any, rank: int, gpu_token: str | None) -> int:
    """One daemon: load, hold, listen, answer until SIGTERM/SIGINT."""
    _die_with_parent()
    root = fakegpu.dir_from_env(dict(os.environ))
    spec = fakegpu.read_spec(root) if root is not None else fakegpu.FakeGpuSpec()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = fakegpu.gpu_for_rank(spec, rank, visible) if gpu_token is None else int(gpu_token)
    sock, ready = paths(spec.uuid(gpu), os.environ)
    who = f"[WeightCacheDaemon gpu={gpu} tp_rank={rank}]"
    log(f"{who} Loading model from disk: {args.model_path}")
    began = time.monotonic()
    for _ in range(args.standin_load_shards):
        time.sleep(1.0 * args.standin_time_scale)
    mib = int(spec.total_mib * WEIGHTS_FRACTION)
    if root is not None:
        fakegpu.write_holder(root, gpu, mib)
    held = _cuda_hold(args.standin_cuda_mib, rank)  # noqa: F841 (held while it serves)
    log(f"{who} Model loaded from disk in {time.monotonic() - began:.2f}s")
    mine = fingerprint(args, rank)
    stop = {"now": False}

    def on_signal(signum: int, _frame: Any) -> None:
        log(f"[WeightCacheDaemon gpu={gpu}] Received signal {signum}, shutting down")
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(sock))
    finally:
        os.umask(old)
    server.listen(8)
    server.settimeout(0.2)
    ready.write_text(f"pid={os.getpid()}\nconfig={mine!r}\n")
    log(f"[WeightCacheDaemon gpu={gpu}] Listening on {sock}")
    try:
        while not stop["now"]:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(30)
                request = _recv(conn)
                kind = request.get("type")
                if kind == "ping":
                    _send(conn, {"status": "ok"})
                elif kind == "fetch_state":
                    if request.get("config") == mine:
                        log(f"[WeightCacheDaemon gpu={gpu}] Serving 291 tensors via torch_ipc")
                        _send(conn, _state(mine, mib))
                    else:
                        diff = {k: (mine.get(k), v) for k, v in request["config"].items()}
                        log(f"[WeightCacheDaemon gpu={gpu}] Config mismatch: {diff}")
                        _send(conn, {"status": "mismatch", "daemon_config": mine})
                else:
                    _send(conn, {"status": "error", "message": f"Unknown request type: {kind}"})
    finally:
        server.close()
        for path in (sock, ready):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if root is not None:
            fakegpu.remove_holder(root)
        log(f"[WeightCacheDaemon gpu={gpu}] Shutdown complete")
    return 0


def _cuda_hold(mib: int, device: int) -> Any:
    """Real GPU memory, as the daemon's weights hold it (`--standin-cuda-mib`; needs torch)."""
    if mib <= 0:
        return None
    import torch  # type: ignore[import-not-found]  # noqa: PLC0415 (a real GPU only)

    block = torch.empty(mib * 2**20, dtype=torch.uint8, device=f"cuda:{device}")
    block.fill_(1)
    torch.cuda.synchronize()
    return block


def _state(mine: dict[str, Any], mib: int) -> dict[str, Any]:
    return {
        "status": "ok",
        "config": mine,
        "entries": {},
        "pid": os.getpid(),
        "transport_backend": "torch_ipc",
        "preloaded_weights_bytes": mib * 1024 * 1024,
    }


def _launch(argv: list[str], args: Any) -> int:
    """The launcher: a child per rank, their readiness, SIGINT stops them."""
    tp = int(args.tp_size or 1)
    root = fakegpu.dir_from_env(dict(os.environ))
    spec = fakegpu.read_spec(root) if root is not None else fakegpu.FakeGpuSpec()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    children = []
    for rank in range(tp):
        gpu = fakegpu.gpu_for_rank(spec, rank, visible)
        cmd = [sys.executable, "-m", "gpuwarden.standin.weightcache", *argv]
        cmd += ["--tp-rank", str(rank), "--gpu-id", str(gpu)]
        children.append((rank, gpu, subprocess.Popen(cmd)))
        pid = children[-1][2].pid
        log(f"Launched weight cache daemon gpu={gpu} pp_rank=0 tp_rank={rank} pid={pid}")
    try:
        for rank, gpu, child in children:
            _, ready = paths(spec.uuid(gpu), os.environ)
            while not ready.exists():
                if child.poll() is not None:
                    raise RuntimeError(
                        f"Weight cache daemon exited prematurely with code {child.returncode}"
                    )
                time.sleep(0.05)
            log(f"Weight cache daemon pp_rank=0 tp_rank={rank} is ready")
        ranks = f"pp_ranks=0..0, tp_ranks=0..{tp - 1}"
        log(f"All {tp} weight cache daemons on node 0 are ready ({ranks})")
        while all(child.poll() is None for _, _, child in children):
            time.sleep(0.2)
        bad = next(child for _, _, child in children if child.poll() is not None)
        log(
            f"Weight cache daemon (pid={bad.pid}) exited with code {bad.returncode}; "
            "terminated the remaining daemons."
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for _, _, child in children:
            if child.poll() is None:
                child.terminate()
        for _, _, child in children:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()


def main(argv: list[str] | None = None) -> int:
    """The launcher, or (with `--tp-rank`/`--gpu-id`, as the launcher starts them) one rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in ("--tp-rank", "--gpu-id") and i + 1 < len(argv):
            own[argv[i]] = argv[i + 1]
            i += 2
            continue
        rest.append(argv[i])
        i += 1
    args, _ = parse(rest)
    if not own:
        return _launch(rest, args)
    return _serve_rank(args, int(own.get("--tp-rank", "0")), own.get("--gpu-id"))


if __name__ == "__main__":
    sys.exit(main())
