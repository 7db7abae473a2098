"""A server that a sweep measures and that answers with one endless line: `/health` and
`/get_server_info` answer 200, and every POST streams `data: ` followed by `--line-mib` MiB of
`x` with no newline (as a broken or hostile server could). Run by the daemon as a config's
command: `python hostile_http.py --port P --line-mib 400`. Prints how many bytes it sent before
the client hung up."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--line-mib", type=int, default=400)
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"internal_states": [{}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            sent = 0
            try:
                self.wfile.write(b"data: ")
                block = b"x" * MIB
                for _ in range(args.line_mib):
                    self.wfile.write(block)
                    sent += len(block)
            except OSError:
                pass
            print(f"sent {sent} bytes of one line", flush=True)

        def log_message(self, format: str, *a: object) -> None:
            return

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
