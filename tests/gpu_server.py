"""A tiny GPU server for the real-GPU tests: holds GPU memory with torch, prints SGLang's ready
line, answers /health, and crashes once after CRASH_AFTER_S when CRASH_MARKER does not exist."""

import argparse
import http.server
import os
import sys
import threading
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--mib", type=int, default=4096)
args = parser.parse_args()

block = torch.empty(args.mib * 2**20, dtype=torch.uint8, device="cuda")
block.fill_(1)
torch.cuda.synchronize()


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
stamp = time.strftime("%Y-%m-%d %H:%M:%S")
print(f"[{stamp}] holding {args.mib} MiB on cuda:0 (pid {os.getpid()})", file=sys.stderr)
print(f"[{stamp}] The server is fired up and ready to roll!", file=sys.stderr, flush=True)
marker = os.environ.get("CRASH_MARKER")
if marker and not os.path.exists(marker):
    time.sleep(float(os.environ.get("CRASH_AFTER_S", "2")))
    open(marker, "w").close()
    print(
        f"[{stamp}] RuntimeError: CUDA error: an illegal memory access was encountered",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)
while True:
    time.sleep(3600)
