"""schemathesis against the daemon's own OpenAPI: bounded examples on every route but the log
stream, state-changing ones included (the configs are stand-ins): no 500, no hang, no
undeclared status or content type, no schema violation.

One check is left out: `negative_data_rejection` fails requests that carry query parameters
the schema does not name; the API ignores unknown parameters, as HTTP APIs commonly do.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import Proc


def test_api_conforms_to_its_own_openapi(procs: list[Proc], tmp_path: Path, fake_gpu: Path) -> None:
    d = start_daemon(
        procs, tmp_path, fake_gpu, {"a": standin_config(), "b": standin_config()}, default="a"
    )
    d.wait_state("ready")
    # /readyz answers 503 by contract while the server is not ready (the stateful phase stops
    # it): a declared answer there, not a server error; every other check still applies.
    (tmp_path / "schemathesis.toml").write_text(
        '[[operations]]\ninclude-path = "/readyz"\n'
        'checks.not_a_server_error.expected-statuses = ["2XX", "3XX", "4XX", 503]\n'
    )
    st = Path(sys.executable).with_name("st")
    res = subprocess.run(
        [
            str(st),
            "run",
            f"{d.url}/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            "negative_data_rejection",
            "--max-examples",
            "10",
            "--exclude-path",
            "/logs/stream",
            "--request-timeout",
            "20",
            "--generation-deterministic",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # its cache (.schemathesis/) stays with the test
    )
    summary = "\n".join(res.stdout.splitlines()[-25:])
    assert res.returncode == 0, summary
    assert " passed" in summary and "failed" not in summary.split("Test cases:")[-1]
    assert d.proc.popen.poll() is None  # the daemon took it all
