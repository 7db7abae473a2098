"""What differs between the SGLang versions the stand-in imitates.

Each `Profile` holds the facts of one version (see SGLANG.md): the argparse `prog`, which flags
exist, the exact log-line templates, and how the process ends on SIGTERM and child death.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSIONS = ("0.4.10", "0.5.5", "0.5.12", "0.5.23")
DEFAULT_VERSION = "0.5.23"


@dataclass(frozen=True)
class Profile:
    version: str
    prog: str
    # --speculative-algorithm: argparse choices, or None for a free string (0.5.23).
    spec_choices: tuple[str, ...] | None
    has_config_flag: bool  # --config file.yaml (0.5.5+)
    has_cuda_graph_max_bs: bool  # --cuda-graph-max-bs (<= 0.5.12)
    has_soft_watchdog: bool  # --soft-watchdog-timeout (0.5.12+)
    entrypoint_warning: bool  # "'python -m sglang.launch_server' is still supported" (0.5.12+)
    sigterm_ends_in_sigkill: bool  # graceful SIGTERM ends in -9 (<= 0.5.12), else exit 0
    subprocess_watchdog: bool  # the parent notices a silently dead child (0.5.12+)
    health_unhealthy_is_sticky: bool  # 0.4.10: any non-Up status answers 503
    uvicorn_bind_failure_exit: int  # uvicorn 0.32 exits 1, uvicorn >= 0.51 exits 3
    new_capture_lines: bool  # 0.5.23's "Capture target decode CUDA graph" wording
    deprecated_info_routes: bool  # /get_server_info, /get_model_info log a deprecation (0.5.12+)
    # After a dead child: 5 s settling, py-spy, then (a scheduler still alive) a 60 s wait for
    # CUDA coredumps, port open and requests hanging, before kill_process_tree (0.5.23).
    crash_diagnostics: bool = False
    # The warm-up thread starts in the app's lifespan, before uvicorn binds, and is joined on
    # the way out: if the bind fails, a warm-up that reaches another server on the port still
    # prints the ready line, then the process exits 3 (0.5.23).
    warmup_before_bind: bool = False

    @property
    def at_least_0_5_12(self) -> bool:
        return self.version in ("0.5.12", "0.5.23")

    # -- log line templates (SGLANG.md §4) ------------------------------------------------------

    def decode_line(
        self,
        *,
        running: int,
        tokens: int,
        usage: float,
        throughput: float,
        queue: int,
        cuda_graph: bool,
        accept_len: float | None = None,
        accept_rate: float | None = None,
    ) -> str:
        spec = ""
        if accept_len is not None:
            spec = f"accept len: {accept_len:.2f}, "
            if self.version != "0.4.10" and accept_rate is not None:
                spec += f"accept rate: {accept_rate:.2f}, "
        head = "Decode batch." if self.version == "0.4.10" else "Decode batch,"
        line = (
            f"{head} #running-req: {running}, #token: {tokens}, token usage: {usage:.2f}, "
            f"{spec}cuda graph: {cuda_graph}, gen throughput (token/s): {throughput:.2f}, "
            f"#queue-req: {queue}"
        )
        return line if self.at_least_0_5_12 else line + ", "

    def prefill_line(
        self,
        *,
        new_seq: int,
        new_token: int,
        cached: int,
        usage: float,
        running: int,
        queue: int,
        input_throughput: float,
    ) -> str:
        head = "Prefill batch." if self.version == "0.4.10" else "Prefill batch,"
        line = (
            f"{head} #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: {cached}, "
            f"token usage: {usage:.2f}, #running-req: {running}, #queue-req: {queue}, "
        )
        if self.at_least_0_5_12:
            line += (
                f"#pending-token: 0, cuda graph: False, "
                f"input throughput (token/s): {input_throughput:.2f}"
            )
        return line

    def accept_rate(self, accept_len: float, num_steps: int, num_draft_tokens: int) -> float:
        """0.5.5: accepted/(fwd*(steps+1)); 0.5.12+: (accepted-fwd)/(fwd*(draft_tokens-1))."""
        if self.at_least_0_5_12:
            return (accept_len - 1.0) / max(1, num_draft_tokens - 1)
        return accept_len / (num_steps + 1)

    def load_weight_end(self, elapsed_s: float, avail_gb: float, usage_gb: float) -> str:
        if self.version == "0.5.23":
            return (
                f"Load weight end. elapsed={elapsed_s:.2f} s, type=LlamaForCausalLM, "
                f"avail mem={avail_gb:.2f} GB, mem usage={usage_gb:.2f} GB."
            )
        return (
            f"Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, "
            f"avail mem={avail_gb:.2f} GB, mem usage={usage_gb:.2f} GB."
        )


_BASE_SPEC_CHOICES = ("EAGLE", "EAGLE3", "NEXTN")

PROFILES: dict[str, Profile] = {
    "0.4.10": Profile(
        version="0.4.10",
        prog="launch_server.py",
        spec_choices=_BASE_SPEC_CHOICES,
        has_config_flag=False,
        has_cuda_graph_max_bs=True,
        has_soft_watchdog=False,
        entrypoint_warning=False,
        sigterm_ends_in_sigkill=True,
        subprocess_watchdog=False,
        health_unhealthy_is_sticky=True,
        uvicorn_bind_failure_exit=1,
        new_capture_lines=False,
        deprecated_info_routes=False,
    ),
    "0.5.5": Profile(
        version="0.5.5",
        prog="launch_server.py",
        spec_choices=(*_BASE_SPEC_CHOICES, "STANDALONE", "NGRAM"),
        has_config_flag=True,
        has_cuda_graph_max_bs=True,
        has_soft_watchdog=False,
        entrypoint_warning=False,
        sigterm_ends_in_sigkill=True,
        subprocess_watchdog=False,
        health_unhealthy_is_sticky=False,
        uvicorn_bind_failure_exit=1,
        new_capture_lines=False,
        deprecated_info_routes=False,
    ),
    "0.5.12": Profile(
        version="0.5.12",
        prog="sglang serve",
        spec_choices=(*_BASE_SPEC_CHOICES, "STANDALONE", "NGRAM"),
        has_config_flag=True,
        has_cuda_graph_max_bs=True,
        has_soft_watchdog=True,
        entrypoint_warning=True,
        sigterm_ends_in_sigkill=True,
        subprocess_watchdog=True,
        health_unhealthy_is_sticky=False,
        uvicorn_bind_failure_exit=3,
        new_capture_lines=False,
        deprecated_info_routes=True,
    ),
    "0.5.23": Profile(
        version="0.5.23",
        prog="sglang serve",
        spec_choices=None,
        has_config_flag=True,
        has_cuda_graph_max_bs=False,
        has_soft_watchdog=True,
        entrypoint_warning=True,
        sigterm_ends_in_sigkill=False,
        subprocess_watchdog=True,
        health_unhealthy_is_sticky=False,
        uvicorn_bind_failure_exit=3,
        new_capture_lines=True,
        deprecated_info_routes=True,
        crash_diagnostics=True,
        warmup_before_bind=True,
    ),
}

# 0.5.23 resolves --speculative-algorithm by name at run time (SGLANG.md §1).
SPEC_ALGORITHMS_0_5_23 = (
    "EAGLE",
    "EAGLE3",
    "NEXTN",
    "STANDALONE",
    "NGRAM",
    "DFLASH",
    "DSPARK",
    "UNO",
)
