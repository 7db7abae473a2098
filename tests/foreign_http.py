"""Another program's HTTP server on a port: 200 with a small JSON body to every GET and POST,
like an unrelated server (or another SGLang) that took the port. Prints `listening PORT` once
bound. Test support, run as its own process: `python foreign_http.py --port P`; with
`--exit-on-usr1 CODE`, SIGUSR1 makes it print a last line and exit with CODE."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-on-usr1", type=int, default=None)
    args = parser.parse_args()
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
