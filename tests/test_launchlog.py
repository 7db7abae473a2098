"""The log pipeline: file first, lines aligned per stream, a parser that never raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.daemon.configs import ConfigStore
from gpuwarden.daemon.launchlog import LaunchLog, LogUnwritable
from gpuwarden.daemon.logfiles import prune_logs, read_tail
from gpuwarden.daemon.resolvedconfig import redacted_header_lines
from gpuwarden.daemon.sglanglines import ParsedLine, parse_line

DECODE = {
    "0.4.10": "[2025-01-01 00:00:00 TP0] Decode batch. #running-req: 1, #token: 86, token usage: 0.00, "
    "accept len: 3.12, cuda graph: True, gen throughput (token/s): 30.41, #queue-req: 0, ",
    "0.5.5": "[2025-01-01 00:00:00] Decode batch, #running-req: 2, #token: 86, token usage: 0.01, "
    "accept len: 3.12, accept rate: 0.52, cuda graph: True, gen throughput (token/s): 30.41, "
    "#queue-req: 3, ",
    "0.5.23": "[2025-01-01 00:00:00.123 DP1 TP4] Decode batch, #running-req: 1, #token: 86, "
    "token usage: 0.00, accept len: 3.12, accept rate: 0.52, cap len: 4.00, cuda graph: True, "
    "gen throughput (token/s): 30.41, #queue-req: 0, fwd occupancy: 88%",
    "hybrid": "[2025-01-01 00:00:00] Decode batch, #running-req: 1, #full token: 5, full token usage: 0.25, "
    "#swa token: 3, swa token usage: 0.10, cuda graph: True, gen throughput (token/s): 30.41, "
    "#queue-req: 0",
}


@pytest.mark.parametrize("variant", sorted(DECODE))
def test_decode_line_variants(variant: str) -> None:
    values = parse_line(DECODE[variant]).decode
    assert values is not None
    assert values["gen_throughput_tok_s"] == 30.41
    if variant != "hybrid":
        assert values["accept_len"] == 3.12
    else:
        assert values["token_usage"] == 0.25 and "accept_len" not in values


def test_findings() -> None:
    cases = {
        "sglang serve: error: unrecognized arguments: --bogus": "config_error",
        "[2025-01-01 00:00:00 TP3] Watchdog timeout (self.watchdog_timeout=300)": "watchdog_timeout",
        "[2025-01-01 00:00:00] ERROR:    [Errno 98] error while attempting to bind on address "
        "('127.0.0.1', 30000): address already in use": "port_in_use",
        "[rank3]:[E1201 ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=1) ran for 600049 milliseconds before timing out.": "nccl_error",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "cuda_oom",
        "Received sigquit from a child proces. It usually means the child failed.": "sigquit",
    }
    for line, kind in cases.items():
        assert kind in [f.kind for f in parse_line(line).findings], line
    assert parse_line("[2025-01-01 00:00:00] The server is fired up and ready to roll!").ready


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=3000))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    parse_line(data.decode("utf-8", errors="replace"))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(max_size=300)), max_size=30))
def test_streams_interleave_only_at_line_boundaries(chunks: list[tuple[int, bytes]]) -> None:
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        log = LaunchLog(Path(tmp) / "x" / "a.log", ["h"])
        for stream, chunk in chunks:
            log.feed(chunk, stream)
        log.close()
        body = (Path(tmp) / "x" / "a.log").read_bytes().split(b"\n", 1)[1]
        for stream in (1, 2):
            data = b"".join(c for s, c in chunks if s == stream)
            for line in data.split(b"\n")[:-1]:
                if len(line) < 1024:
                    assert line + b"\n" in b"\n" + body or line == b""


def test_unwritable_log_raises(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(LogUnwritable):
        LaunchLog(tmp_path / "file" / "x.log", [])


def test_retention_keeps_the_protected_launches(tmp_path: Path) -> None:
    for i in range(6):
        p = tmp_path / "cfg" / f"20260101T0000{i:02d}-00000{i}.log"
        p.parent.mkdir(exist_ok=True)
        p.write_text("x" * 100)
    protect = {"20260101T000000-000000"}
    removed = prune_logs(tmp_path, keep_launches=3, max_bytes=10**9, protect=protect)
    left = sorted(p.stem for p in (tmp_path / "cfg").iterdir())
    assert len(removed) == 3
    assert left == ["20260101T000000-000000", "20260101T000004-000004", "20260101T000005-000005"]
    assert read_tail(tmp_path / "cfg" / "20260101T000005-000005.log", 5) == ["x" * 100]


def test_control_characters_in_argv_cannot_add_header_lines(tmp_path: Path) -> None:
    forged = "m\n# argv: forged --api-key none\r\x1b[2K\u2028# env overrides: forged"
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump(
            {
                "command": ["server"],
                "args": {"served-model-name": forged},
                "env": {"NOTE": "a\nb"},
                "preflight": {"argv": False},
            }
        )
    )
    header = ["gpuwarden launch x", *redacted_header_lines(ConfigStore(tmp_path).load("c"))]
    log = LaunchLog(tmp_path / "x.log", header)
    log.feed(b"first server line\n")
    log.close("ended\nforged trailer")
    lines = (tmp_path / "x.log").read_text().splitlines()
    assert len(lines) == len(header) + 2
    assert [line for line in lines if line.startswith("# argv: ")] == [
        "# argv: server --served-model-name "
        "m\\n# argv: forged --api-key none\\r\\x1b[2K\\u2028# env overrides: forged"
    ]
    assert "# env overrides: NOTE=a\\nb" in lines
    assert lines[-2:] == ["first server line", "# ended\\nforged trailer"]


DEATHS = [
    "[2026-12-02 10:00:01] Subprocess scheduler_0 (pid=41) crashed with exit code -9. "
    "Triggering SIGQUIT for cleanup...",
    "[2026-12-02 10:00:01] Subprocess detokenizer (pid=42) crashed with exit code -9. "
    "Triggering SIGQUIT for cleanup...",
    "[2026-12-02 10:00:01] SIGQUIT received. signum=None, frame=None. It usually means one "
    "child failed.",
    "[2026-12-02 10:00:01] Received sigquit from a child process. It usually means the child "
    "failed.",
    "[2026-12-02 10:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    "[2026-12-02 10:00:01] DetokenizerManager hit an exception: Traceback (most recent call last):",
    "[2026-12-02 10:00:01] TokenizerManager hit an exception: Traceback (most recent call last):",
    "[2026-12-02 10:00:01] ERROR:    [Errno 98] error while attempting to bind on address "
    "('127.0.0.1', 30000): address already in use",
]
NOT_DEATHS = [
    "[2026-12-02 10:00:01] Sleeping 5 seconds before crash diagnostics to let GPU activity settle.",
    "[2026-12-02 10:00:01] Health check failed. Server couldn't get a response from detokenizer",
    '[2026-12-02 10:00:01] INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK',
    "[2026-12-02 10:00:01] user text: the scheduler hit an exception once, says the prompt",
    # Text a client controls: a logged request, a traceback's continuation lines, no prefix.
    "[2026-12-02 10:00:01] Receive: obj=GenerateReqInput(text='ERROR:    [Errno 98] error "
    "while attempting to bind on address x SIGQUIT received. ')",
    "SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
    "Scheduler hit an exception: Traceback (most recent call last):",
    "RuntimeError: Subprocess scheduler_0 (pid=41) crashed with exit code -9.",
]


def test_sglangs_death_announcements_are_recognised_through_the_log_pipeline(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, ParsedLine]] = []
    log = LaunchLog(tmp_path / "x" / "a.log", ["h"], on_lines=lambda _, p: seen.extend(p))
    log.feed("".join(line + "\n" for line in DEATHS + NOT_DEATHS).encode())
    log.close("done")
    deaths = [text for text, parsed in seen if parsed.death]
    assert deaths == DEATHS


def test_a_capped_log_keeps_its_head_and_tail_and_counts_what_it_dropped(tmp_path: Path) -> None:
    path = tmp_path / "l" / "x.log"
    log = LaunchLog(path, ["hdr"], max_bytes=4096)
    lines = [b"line %05d xxxxxxxxxxxxxxxxxxxxxx\n" % i for i in range(2000)]
    for line in lines:
        log.feed(line)
    data = path.read_bytes()
    assert len(data) <= 4096
    head, marker, tail = data.partition(b"# gpuwarden: ")
    assert head.startswith(b"# hdr\nline 00000 ") and len(head) <= 1024
    dropped = int(marker and tail.split(b" ", 1)[0])
    rest = tail.split(b"\n", 1)[1]
    assert rest.endswith(lines[-1]) and b"# gpuwarden" not in rest
    assert len(head) + dropped + len(rest) == 6 + sum(map(len, lines))  # nothing counted twice
