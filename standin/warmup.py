"""The warm-up after which the server is ready, and the output faults that follow it.

`warmup` is SGLang's: wait for the info route to answer, then an 8-token ``/generate``; a
failure logs ``Initialization failed`` and kills the tree. Its end marks the server ``Up``,
prints the ready line and tells the children; `output_faults` then writes what
``--standin-flood``, ``--standin-invalid-utf8``, ``--standin-long-line`` and
``--standin-escape-sequences`` ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from .logline import log
from .tree import kill_process_tree

if TYPE_CHECKING:
    from .server import StandinServer


async def warmup(server: StandinServer) -> None:
    import httpx  # noqa: PLC0415

    base = f"http://{server.args.host}:{server.args.port}"
    headers = {"Authorization": f"Bearer {server.args.api_key}"} if server.args.api_key else {}
    if not server.args.skip_server_warmup:
        await asyncio.sleep(server.seconds("warmup_sleep"))
        try:
            # 0.5.12+ asks the new route (the old one logs a deprecation).
            info = "/model_info" if server.profile.deprecated_info_routes else "/get_model_info"
            async with httpx.AsyncClient(headers=headers, timeout=600, trust_env=False) as c:
                for _ in range(120):
                    with contextlib.suppress(httpx.HTTPError):
                        if (await c.get(base + info, timeout=5)).status_code == 200:
                            break
                    await asyncio.sleep(server.seconds("warmup_sleep"))
                res = await c.post(
                    base + "/generate",
                    json={
                        "text": "The capital city of France is",
                        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                    },
                )
                res.raise_for_status()
        except Exception:
            import traceback  # noqa: PLC0415

            log(f"Initialization failed. warmup error: {traceback.format_exc()}")
            kill_process_tree(os.getpid())
    server.state.status = "Up"
    log("The server is fired up and ready to roll!")
    for _, _, conn in server.children:
        with contextlib.suppress(OSError):
            conn.send(("ready",))
    threading.Thread(
        target=output_faults, args=(server,), name="output-faults", daemon=True
    ).start()


def output_faults(server: StandinServer) -> None:
    faults = server.cfg.faults
    out = sys.stderr.buffer
    stamp = time.strftime("%Y-%m-%d %H:%M:%S").encode()
    if faults.flood_lines:
        chunk: list[bytes] = []
        for i in range(faults.flood_lines):
            chunk.append(b"[%s] flood line %08d %s\n" % (stamp, i, b"x" * 40))
            if len(chunk) == 1000:
                out.write(b"".join(chunk))
                chunk.clear()
        out.write(b"".join(chunk))
        out.write(b"[%s] flood done: %d lines\n" % (stamp, faults.flood_lines))
    if faults.invalid_utf8:
        out.write(b"[%s] invalid bytes: \xff\xfe\xc3\x28 \x80 end\n" % stamp)
    if faults.long_line_bytes:
        out.write(b"[%s] long line: %s\n" % (stamp, b"L" * faults.long_line_bytes))
    if faults.escape_sequences:  # a window title, clear screen, red, reset, a C1 CSI (UTF-8)
        out.write(
            b"[%s] hostile: \x1b]0;pwned\x07\x1b[2J\x1b[31mred\x1b[0m \xc2\x9b1m end\n" % stamp
        )
    out.flush()
