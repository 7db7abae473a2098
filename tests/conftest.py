"""Fixtures shared by the test files: `procs` (children a test starts; none may outlive it), a
fake GPU folder, the stand-in, another program's HTTP server. The helpers they use, and that
tests import, live in tests/support/ (see tests/README.md)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwarden.standin import fakegpu

from .support.procs import PY, Proc, free_port, owned_processes
from .support.proxy import end_proxies
from .support.shim import end_shims

# A run started in the background by a non-interactive shell ignores SIGINT, and so would every
# child it starts (an ignored signal stays ignored across exec): the tests that stop a CLI with
# Ctrl-C need it delivered.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Children started by a test; afterwards no member of their process groups, and no server
    a daemon of theirs launched, may be alive. Each child gets SIGTERM first (a daemon then
    stops its server), SIGKILL to its group only if it does not exit."""
    with owned_processes() as started:
        yield started


@pytest.fixture(autouse=True)
def _shims_ended(tmp_path: Path) -> Iterator[None]:
    """Every daemon runs its servers under a shim of its state directory, which outlives a
    daemon that is SIGKILLed, as its front proxy does: after the test (and after `procs` has
    ended its daemons and their servers), the shims and proxies of the test's folder are
    ended."""
    yield
    root = str(tmp_path)
    end_shims(lambda folder: folder == root or folder.startswith(root + os.sep))
    end_proxies(lambda path: path.startswith(root + os.sep))


@pytest.fixture
def fake_gpu(tmp_path: Path) -> Path:
    return fakegpu.init_dir(tmp_path / "fakegpu", count=8)


@pytest.fixture
def standin(procs: list[Proc], fake_gpu: Path) -> Callable[..., Proc]:
    """Start the stand-in: `standin("--tp-size", "2", version="0.5.5", scale=0.01)`."""

    def start(
        *args: str,
        version: str = "0.5.23",
        scale: float = 0.01,
        port: int | None = None,
        model: str | None = "/models/fake",
        env: dict[str, str] | None = None,
    ) -> Proc:
        argv = [PY, "-m", "gpuwarden.standin"]
        if model is not None:
            argv += ["--model-path", model]
        argv += ["--port", str(port or free_port()), "--standin-version", version]
        argv += ["--standin-time-scale", str(scale), *args]
        full_env = {**os.environ, fakegpu.ENV_DIR: str(fake_gpu), "PYTHONUNBUFFERED": "1"}
        full_env.update(env or {})
        proc = Proc(argv, env=full_env)
        proc.port = int(argv[argv.index("--port") + 1])  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    return start


@pytest.fixture
def foreign_http(procs: list[Proc]) -> Callable[[int], Proc]:
    """Another program's HTTP server on `port` (200 to everything), as its own process."""

    def start(port: int) -> Proc:
        proc = Proc([PY, str(Path(__file__).with_name("foreign_http.py")), "--port", str(port)])
        procs.append(proc)
        proc.wait_for(rf"^listening {port}$")
        return proc

    return start
