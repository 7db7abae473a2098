"""Another program's HTTP server on a port: 200 with a small JSON body to every GET and POST,
like an unrelated server (or another SGLang) that took the port. Prints `listening PORT` once
bound. Test support, run as its own process: `python foreign_http.py --port P`; with
`--exit-on-usr1 CODE`, SIGUSR1 makes it print a last line and exit with CODE; with
`--flood-on-usr2 N`, SIGUSR2 makes it write N numbered lines to stdout as fast as it can, then
`flood done, longest write MS ms`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = json.dumps({"is_generation": True, "model_path": "someone-else", "text": "hi"}).encode()


class Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    do_GET = _answer
    do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        return


def flooder(go: threading.Event, lines: int) -> None:
    go.wait()
    longest = 0.0
    batch = 1000
    for start in range(0, lines, batch):
        chunk = "".join(f"flood line {i:08d}\n" for i in range(start, min(lines, start + batch)))
        t0 = time.perf_counter()
        os.write(1, chunk.encode())
        longest = max(longest, time.perf_counter() - t0)
    os.write(1, f"flood done, longest write {longest * 1000:.3f} ms\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-on-usr1", type=int, default=None)
    parser.add_argument("--flood-on-usr2", type=int, default=0)
    args = parser.parse_args()
    if args.flood_on_usr2:
        flood = threading.Event()
        signal.signal(signal.SIGUSR2, lambda signum, frame: flood.set())
        threading.Thread(target=flooder, args=(flood, args.flood_on_usr2), daemon=True).start()
    if args.exit_on_usr1 is not None:

        def last_words(signum: int, frame: object) -> None:
            print(f"last words, then exit {args.exit_on_usr1}", flush=True)
            os._exit(args.exit_on_usr1)

        signal.signal(signal.SIGUSR1, last_words)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening {server.server_address[1]}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
