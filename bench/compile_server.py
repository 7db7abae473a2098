"""A server whose start is a torch.compile (inductor's C++ on the CPU) of the tiny Llama that
`make test-real` builds, with SGLang's own phase lines, for `bench/compilecache.py`.

SGLang 0.5.23's compile path on the CPU (`--enable-torch-compile`, its CPU graph runner) needs
the Intel AMX attention backend; on a CPU without AMX it fails at capture
(`'TorchNativeAttnBackend' object has no attribute 'init_cpu_graph_state'`). This is the same
compiler and the same caches (TORCHINDUCTOR_CACHE_DIR, as gpuwarden gives them), run by the
environment's own torch: `python bench/compile_server.py MODEL_DIR PORT`. On a GPU,
`python bench/compile_server.py --synthetic PORT` compiles four transformer layers on CUDA
instead (inductor's Triton kernels: TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import http.server
import sys
import threading
import time


def log(msg: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    model_dir, port = sys.argv[1], int(sys.argv[2])
    import torch  # noqa: PLC0415 - the environment's, imported as the server starts
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    log("Load weight begin. avail mem=0.00 GB")
    start = time.perf_counter()
    if model_dir == "--synthetic":
        layers = [torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)]
        model = torch.nn.Sequential(*(layers * 4)).cuda().half().eval()
        inputs: dict[str, torch.Tensor] = {"input": torch.randn(8, 128, 1024).cuda().half()}
        kind = "CUDA"
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().model
        inputs = {"input_ids": torch.randint(0, 100, (1, 16))}
        kind = "CPU"
    log(f"Load weight end. elapsed={time.perf_counter() - start:.2f} s")
    log("KV Cache is allocated. dtype: torch.float32, #tokens: 0")
    log(f"Capture target decode {kind} graph begin. backend=inductor")
    start = time.perf_counter()
    compiled = torch.compile(model, dynamic=False)
    with torch.inference_mode():
        compiled(**inputs)
    if kind == "CUDA":
        torch.cuda.synchronize()
    log(f"Capture target decode {kind} graph end. elapsed={time.perf_counter() - start:.2f} s")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    print(f"INFO:     Uvicorn running on http://127.0.0.1:{port}", file=sys.stderr, flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log("The server is fired up and ready to roll!")
    threading.Event().wait()


if __name__ == "__main__":
    main()
