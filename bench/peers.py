"""The supervisors measured side by side: gpuwarden, supervisord (PyPI) and PM2 (npm).

Each tool runs the same tiny Python child programs, in the same run, one tool at a time (the
restart rows interleave the tools round by round, `bench/restart.py`; the 60 s defaults row runs
the three at once: it counts starts, it does not time them).
Every tool is told about the child the way its users would: gpuwarden by a settings file and a
config, supervisord by an ini file with one `[program:child]`, PM2 by an ecosystem JSON file with
`interpreter: none`. Each tool's reports are read from its push channel, with the time an outside
observer received them: gpuwarden's JSON records on its stdout, a supervisord event listener
(`PROCESS_STATE`), PM2's bus (`process:event`, through PM2's own node module).

The peers live in `bench/.peers/` (made by `make bench`): a venv holding supervisor and an npm
prefix holding pm2. Nothing of theirs is vendored into the project.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Run as a script, this module is also `peers` to bench/restart.py: one copy of the tools.
sys.modules.setdefault("peers", sys.modules[__name__])
import core  # noqa: E402 - bench/core.py, next to this file

PY = core.PY
PEERS = Path(os.environ.get("GPUWARDEN_BENCH_PEERS", HERE / ".peers"))
SUPERVISORD = PEERS / "venv" / "bin" / "supervisord"
SUPERVISORCTL = PEERS / "venv" / "bin" / "supervisorctl"
PM2_PREFIX = PEERS / "npm"
PM2_BIN = PM2_PREFIX / "node_modules" / ".bin" / "pm2"
PM2_MODULE = PM2_PREFIX / "node_modules" / "pm2"

# -- the child programs (run as script files: see py()) --------------------------------------------

# Notes its first instruction's time and, after DELAY s, its last one's; then exits 1.
CRASHER = """
import os, sys, time
t = time.time()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, f"{t} ".encode())
time.sleep(float(sys.argv[2]))
os.write(fd, f"{time.time()}\\n".encode())
sys.exit(1)
"""

# Writes N 80-byte lines to stdout (one write each, or through a 64 KiB buffer), records its wall
# time, then dies by SIGKILL right after the last write. Only the first launch writes (ONCE file).
WRITER = """
import os, signal, sys, time
n, mode, wall_file, once = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
except FileExistsError:
    time.sleep(3600)
line = b"x" * 79 + b"\\n"
t0 = time.perf_counter()
out = open(1, "wb", buffering=0 if mode == "line" else 1 << 16, closefd=False)
for _ in range(n):
    out.write(line)
out.flush()
wall = time.perf_counter() - t0
with open(wall_file, "w") as f:
    f.write(f"{wall:.6f}")
os.kill(os.getpid(), signal.SIGKILL)
"""

# Ignores the polite stop signals (TERM, INT, HUP: PM2 sends INT), noting when each arrived.
STUBBORN = """
import os, signal, sys, time
def note(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write(f"{signum} {time.time()}\\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, note)
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
while True:
    time.sleep(3600)
"""

# Starts a grandchild, in its own process group (`same`) or detached by setsid + double fork
# (`detached`), writes its pid, and sleeps; the default SIGTERM action ends it.
PARENT = """
import os, subprocess, sys, time
kind, pid_file = sys.argv[1], sys.argv[2]
sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
if kind == "same":
    pid = subprocess.Popen(sleeper).pid
else:
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            os.execv(sys.executable, sleeper)
        os._exit(0)
    pid = int(os.read(r, 32))
    os.wait()
with open(pid_file + ".tmp", "w") as f:
    f.write(str(pid))
os.replace(pid_file + ".tmp", pid_file)
while True:
    time.sleep(3600)
"""

SLEEPER = "import time; time.sleep(3600)"

# Prints SGLang's ready line, then sleeps: under gpuwarden it is `ready`, so nothing is probed
# more often than the config's liveness interval (an hour here: the peers probe nothing).
READY_SLEEPER = """
import sys, time
print("[2026-01-01 00:00:00] The server is fired up and ready to roll!", flush=True)
time.sleep(3600)
"""

# A supervisord event listener: notes each event with the time it arrived.
LISTENER = """
import sys, time
out = open(sys.argv[1], "a", buffering=1)
while True:
    sys.stdout.write("READY\\n"); sys.stdout.flush()
    header = sys.stdin.readline()
    t = time.time()
    fields = dict(x.split(":", 1) for x in header.split())
    payload = sys.stdin.read(int(fields["len"]))
    out.write(f"{t} {fields['eventname']} {payload}\\n")
    sys.stdout.write("RESULT 2\\nOK"); sys.stdout.flush()
"""

# PM2's bus, through PM2's own module: every process event with the time it arrived.
PM2_OBSERVER = """
const pm2 = require(process.argv[2]);
const fs = require('fs');
const out = fs.openSync(process.argv[3], 'a');
pm2.connect(true, (err) => {
  if (err) { console.error(err); process.exit(1); }
  pm2.launchBus((err2, bus) => {
    if (err2) { console.error(err2); process.exit(1); }
    bus.on('process:event', (p) => {
      const t = (performance.timeOrigin + performance.now()) / 1000;
      fs.writeSync(out, JSON.stringify({t: t, event: p.event, pid: p.process.pid,
                                        status: p.process.status}) + '\\n');
    });
    fs.writeSync(out, JSON.stringify({t: Date.now() / 1000, event: 'observing'}) + '\\n');
  });
});
"""


_SCRIPTS: dict[str, Path] = {}


def script_file(code: str, suffix: str = ".py") -> Path:
    script = _SCRIPTS.get(code)
    if script is None:
        folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpuwarden-bench-{os.getpid()}"
        if not folder.exists():
            folder.mkdir()
            atexit.register(shutil.rmtree, folder, True)
        script = folder / f"script{len(_SCRIPTS)}{suffix}"
        script.write_text(code)
        _SCRIPTS[code] = script
    return script


def py(code: str, *args: str) -> list[str]:
    """The argv running CODE as a script file (one argv for every tool: supervisord's `command`
    is a single line, so `python -c CODE` cannot be handed over as is)."""
    return [PY, str(script_file(code)), *args]


@dataclass
class Program:
    """One child program and how it is supervised."""

    argv: list[str]
    policy: str = "min"  # "min": each tool's minimum restart delay; "defaults": its defaults
    stop_timeout_s: float = 1.0
    autorestart: bool = True
    observe: bool = True  # run the tool's observer (off for the idle figures)
    gw_settings: dict[str, Any] = field(default_factory=dict)  # gpuwarden only: more settings
    gw_config: dict[str, Any] = field(default_factory=dict)  # gpuwarden only: more config keys
    gw_env: dict[str, str] = field(default_factory=dict)  # gpuwarden only: the daemon's env


@dataclass
class Event:
    t: float  # when the observer received it (host CLOCK_REALTIME)
    kind: str  # "start", "exit", "stopped", "gave_up"


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, 30 s, then SIGKILL: how the supervisors themselves are stopped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vm_hwm_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def alive(pid: int, create_time: float | None = None) -> bool:
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.05:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Tool:
    name = ""

    def __init__(self, root: Path, prog: Program) -> None:
        self.root = root
        self.prog = prog
        root.mkdir(parents=True, exist_ok=True)
        self.out_log = root / "child.out"

    def start(self) -> None:
        raise NotImplementedError

    def events(self) -> list[Event]:
        raise NotImplementedError

    def supervisor_pid(self) -> int:
        raise NotImplementedError

    def request_stop(self) -> None:
        raise NotImplementedError

    def state(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def status_command(self) -> tuple[list[str], dict[str, str]]:
        """The tool's own CLI asking for the child's status, and its environment."""
        raise NotImplementedError

    def wait_event(self, kind: str, count: int = 1, timeout: float = 60) -> list[Event]:
        found: list[Event] = []

        def enough() -> bool:
            found[:] = [e for e in self.events() if e.kind == kind]
            return len(found) >= count

        wait_until(enough, timeout, f"{self.name}: {count} x {kind}")
        return found

    def log_bytes(self) -> bytes:
        return self.out_log.read_bytes() if self.out_log.exists() else b""


class Gpuwarden(Tool):
    name = "gpuwarden"

    def start(self) -> None:
        (self.root / "configs").mkdir(exist_ok=True)
        cfg = {
            "command": self.prog.argv,
            # Not an HTTP server: it stays `starting`; its argv is not SGLang's.
            "health": {
                "url": "http://127.0.0.1:9/health",
                "startup_timeout_s": 3600,
                "interval_s": 3600,
            },
            "preflight": {"argv": False},
            **self.prog.gw_config,
        }
        (self.root / "configs" / "child.yaml").write_text(yaml.safe_dump(cfg))
        settings: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "default_config": "child",
            "gpu": {"backend": "none"},
            "state_dir": str(self.root / "state"),
            "log_dir": str(self.root / "logs"),
            "stop": {"grace_s": self.prog.stop_timeout_s},
        }
        if self.prog.policy == "min":
            settings["restart"] = {"initial_delay_s": 0, "jitter": 0, "crash_loop_after": 10**6}
            settings["log_retention"] = {"launches": 10**5}
        settings.update(self.prog.gw_settings)
        (self.root / "settings.yaml").write_text(yaml.safe_dump(settings))
        self._records: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [
                PY,
                "-m",
                "gpuwarden.api.cli",
                "serve",
                "--settings",
                str(self.root / "settings.yaml"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.prog.gw_env},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        url: list[str] = []

        def listening() -> bool:
            url[:] = [str(r["url"]) for _, r in self.records() if r.get("event") == "api.listening"]
            return bool(url)

        wait_until(listening, 30, "gpuwarden to listen")
        self.url = url[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with (self.root / "daemon.log").open("wb") as log:
            for line in self.proc.stdout:
                t = time.time()
                log.write(line)
                if line.startswith(b"{"):
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        with self._lock:
                            self._records.append((t, rec))

    def records(self) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return list(self._records)

    def events(self) -> list[Event]:
        out = []
        for t, r in self.records():
            ev, to = r.get("event"), r.get("to")
            if ev == "server.launch":
                out.append(Event(t, "start"))
            elif ev == "server.state" and ("returncode" in r or "signal" in r):
                out.append(Event(t, "exit"))
            elif ev == "server.state" and to == "stopped":
                out.append(Event(t, "stopped"))
            elif ev == "server.state" and to in ("crash_loop", "failed"):
                out.append(Event(t, "gave_up"))
        return out

    def log_files(self) -> list[Path]:
        return sorted((self.root / "logs" / "child").glob("*.log"))

    def log_bytes(self) -> bytes:
        return b"".join(p.read_bytes() for p in self.log_files())

    def supervisor_pid(self) -> int:
        return self.proc.pid

    def _post(self, path: str) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", path)
        conn.getresponse().read()
        conn.close()

    def request_stop(self) -> None:
        self._post("/stop")

    def state(self) -> str:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/status")
        status = json.loads(conn.getresponse().read())
        conn.close()
        return str(status["state"]) + (", crash loop" if status.get("crash_loop") else "")

    def close(self) -> None:
        end(self.proc)
        self._reader.join(10)

    def status_command(self) -> tuple[list[str], dict[str, str]]:
        return [str(Path(PY).parent / "gpuwarden"), "status", "--url", self.url], dict(os.environ)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(self.unix_path)
        self.sock = s


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.unix_path = path

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        return _UnixConnection(self.unix_path)


class Supervisord(Tool):
    name = "supervisord"

    def start(self) -> None:
        r = self.root
        self.sock = r / "supervisor.sock"
        self.events_file = r / "events.txt"
        options = {
            "command": " ".join(shlex.quote(a) for a in self.prog.argv),
            "stdout_logfile": str(self.out_log),
            "stdout_logfile_maxbytes": "0",
            "stderr_logfile": str(r / "child.err"),
            "stderr_logfile_maxbytes": "0",
            "stopwaitsecs": f"{self.prog.stop_timeout_s:g}",
        }
        if self.prog.policy == "min":
            options.update(autorestart="true", startsecs="0", startretries="1000000")
        if not self.prog.autorestart:
            options["autorestart"] = "false"
        program = ["[program:child]", *(f"{k}={v}" for k, v in options.items())]
        listener = []
        if self.prog.observe:
            listener = [
                "[eventlistener:observer]",
                "command=" + " ".join(shlex.quote(a) for a in py(LISTENER, str(self.events_file))),
                "events=PROCESS_STATE",
                "buffer_size=10000",
                f"stderr_logfile={r / 'listener.err'}",
            ]
        ini = [
            "[supervisord]",
            "nodaemon=true",
            f"logfile={r / 'supervisord.log'}",
            f"pidfile={r / 'supervisord.pid'}",
            f"childlogdir={r}",
            "[unix_http_server]",
            f"file={self.sock}",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            *program,
            *listener,
        ]
        (r / "supervisord.conf").write_text("\n".join(ini) + "\n")
        self.proc = subprocess.Popen(
            [str(SUPERVISORD), "-n", "-c", str(r / "supervisord.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            cwd=r,
        )
        wait_until(self.sock.exists, 30, "supervisord's socket")
        self.rpc = xmlrpc.client.ServerProxy(
            "http://localhost", transport=_UnixTransport(str(self.sock))
        )
        if self.prog.observe:
            wait_until(self.events_file.exists, 30, "the event listener")

    KINDS = {
        "PROCESS_STATE_RUNNING": "start",
        "PROCESS_STATE_EXITED": "exit",
        "PROCESS_STATE_BACKOFF": "exit",
        "PROCESS_STATE_STOPPED": "stopped",
        "PROCESS_STATE_FATAL": "gave_up",
    }

    def events(self) -> list[Event]:
        if not self.events_file.exists():
            return []
        out = []
        for line in self.events_file.read_text().splitlines():
            parts = line.split(" ", 2)
            if len(parts) < 3 or "processname:child " not in parts[2] + " ":
                continue
            kind = self.KINDS.get(parts[1])
            if kind:
                out.append(Event(float(parts[0]), kind))
        return out

    def supervisor_pid(self) -> int:
        return self.proc.pid

    def request_stop(self) -> None:
        try:
            self.rpc.supervisor.stopProcess("child", False)
        except xmlrpc.client.Fault as exc:
            if "NOT_RUNNING" not in exc.faultString:  # between two runs of a crashing child
                raise

    def state(self) -> str:
        info = self.rpc.supervisor.getProcessInfo("child")
        return str(info["statename"])  # type: ignore[index]

    def status_command(self) -> tuple[list[str], dict[str, str]]:
        return [str(SUPERVISORCTL), "-s", f"unix://{self.sock}", "status"], dict(os.environ)

    def close(self) -> None:
        end(self.proc)


class Pm2(Tool):
    name = "PM2"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "PM2_HOME": str(self.root / "pm2home"), "PM2_DISABLE_UPDATE": "1"}

    def _pm2(self, *args: str, timeout: float = 60) -> str:
        res = subprocess.run(
            [str(PM2_BIN), *args],
            check=False,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if res.returncode != 0:
            raise RuntimeError(f"pm2 {' '.join(args)}: {res.stderr or res.stdout}")
        return res.stdout

    def start(self) -> None:
        r = self.root
        app: dict[str, Any] = {
            "name": "child",
            "script": self.prog.argv[0],
            "args": self.prog.argv[1:],
            "interpreter": "none",
            "exec_mode": "fork",
            "out_file": str(self.out_log),
            "error_file": str(r / "child.err"),
            "pid_file": str(r / "child.pid"),
            "kill_timeout": int(self.prog.stop_timeout_s * 1000),
            "autorestart": self.prog.autorestart,
        }
        if self.prog.policy == "min":
            app.update({"restart_delay": 0, "max_restarts": 10**6})
        (r / "ecosystem.json").write_text(json.dumps({"apps": [app]}))
        self.events_file = r / "events.jsonl"
        # The daemon first, with the observer on its bus, then the app.
        self._pm2("ping")
        self.daemon_pid = int((r / "pm2home" / "pm2.pid").read_text())
        self.observer: subprocess.Popen[bytes] | None = None
        if self.prog.observe:
            self.observer = subprocess.Popen(
                [
                    "node",
                    str(script_file(PM2_OBSERVER, ".js")),
                    str(PM2_MODULE),
                    str(self.events_file),
                ],
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=(r / "observer.err").open("wb"),
            )
            wait_until(
                lambda: self.events_file.exists() and b"observing" in self.events_file.read_bytes(),
                30,
                "the PM2 bus observer",
            )
        self._pm2("start", str(r / "ecosystem.json"))

    KINDS = {"online": "start", "exit": "exit", "stop": "stopped", "restart overlimit": "gave_up"}

    def events(self) -> list[Event]:
        if not self.events_file.exists():
            return []
        out = []
        for line in self.events_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                kind = self.KINDS.get(rec.get("event", ""))
                if kind:
                    out.append(Event(float(rec["t"]), kind))
        return out

    def supervisor_pid(self) -> int:
        return self.daemon_pid

    def request_stop(self) -> None:
        self._pm2("stop", "child")

    def state(self) -> str:
        procs = json.loads(self._pm2("jlist"))
        return str(procs[0]["pm2_env"]["status"]) if procs else "absent"

    def status_command(self) -> tuple[list[str], dict[str, str]]:
        return [str(PM2_BIN), "status"], self._env()

    def close(self) -> None:
        if self.observer is not None:
            self.observer.kill()
            self.observer.wait()
        with contextlib.suppress(Exception):
            self._pm2("kill", timeout=60)
        if alive(self.daemon_pid):
            os.kill(self.daemon_pid, signal.SIGKILL)


TOOLS: list[type[Tool]] = [Gpuwarden, Supervisord, Pm2]


@contextlib.contextmanager
def running(cls: type[Tool], root: Path, prog: Program) -> Any:
    tool = cls(root, prog)
    try:
        tool.start()
        yield tool
    finally:
        tool.close()


STOP_KIND = {"gpuwarden": "stopped", "supervisord": "stopped", "PM2": "exit"}


def stamps(path: Path) -> list[list[float]]:
    """Lines of `start [end]` from CRASHER runs (the last may lack its end)."""
    if not path.exists():
        return []
    return [[float(x) for x in line.split()] for line in path.read_text().splitlines(True)]


def first_after(events: list[Event], kind: str, t: float) -> Event | None:
    return next((e for e in events if e.kind == kind and e.t >= t), None)


def measure_defaults(seconds: float, tmp: Path) -> dict[str, Any]:
    """Each tool's defaults, all three at once, with a child that crashes 0.2 s after start."""
    out: dict[str, Any] = {}
    tools = []
    try:
        for cls in TOOLS:
            path = tmp / f"{cls.name}-defaults.txt"
            prog = Program(py(CRASHER, str(path), "0.2"), policy="defaults", stop_timeout_s=10)
            tool = cls(tmp / f"{cls.name}-defaults", prog)
            t0 = time.time()
            tool.start()
            tools.append((tool, path, t0))
        time.sleep(seconds)
        for tool, path, t0 in tools:
            runs = stamps(path)
            out[tool.name] = {
                "starts": len(runs),
                "state": tool.state(),
                "last_start_s": runs[-1][0] - t0 if runs else None,
            }
    finally:
        for tool, _, _ in tools:
            tool.close()
    return out


def count_lines(data: bytes) -> int:
    return data.count(b"x" * 79 + b"\n")


def settle_lines(read: Callable[[], bytes], timeout: float = 30) -> int:
    """The line count once it has not changed for 1 s."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count_lines(read())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            break
        time.sleep(0.1)
    return last


def measure_capture(cls: type[Tool] | None, lines: int, mode: str, tmp: Path) -> dict[str, Any]:
    """One run of WRITER under the tool (None: straight to a file)."""
    name = cls.name if cls else "direct"
    root = tmp / f"{name}-capture-{mode}"
    root.mkdir(parents=True, exist_ok=True)
    wall_file, once = root / "wall.txt", root / "once"
    argv = py(WRITER, str(lines), mode, str(wall_file), str(once))
    try:
        if cls is None:
            with (root / "direct.out").open("wb") as f:
                subprocess.run(argv, stdout=f, check=False)
            data = (root / "direct.out").read_bytes()
            return {"wall_s": float(wall_file.read_text()), "lines": count_lines(data)}
        with running(cls, root, Program(argv, autorestart=False)) as tool:
            wait_until(wall_file.exists, 300, f"{name}: the writer to finish")
            tool.wait_event("exit", timeout=120)
            found = settle_lines(tool.log_bytes)
            peak = vm_hwm_mib(tool.supervisor_pid())
        return {"wall_s": float(wall_file.read_text()), "lines": found, "peak_rss_mib": peak}
    finally:
        shutil.rmtree(root, ignore_errors=True)  # 40 MB a run


def measure_stop(cls: type[Tool], tmp: Path, rep: int) -> dict[str, Any]:
    """A child that ignores the polite signal, under a 1 s stop timeout."""
    root = tmp / f"{cls.name}-stop-{rep}"
    sig, up = root / "signals.txt", root / "up.txt"
    root.mkdir(parents=True, exist_ok=True)
    with running(cls, root, Program(py(STUBBORN, str(sig), str(up)))) as tool:
        wait_until(up.exists, 30, f"{cls.name}: the stubborn child")
        tool.wait_event("start")
        child = psutil.Process(int(up.read_text()))
        t_req = time.time()
        tool.request_stop()
        kind = STOP_KIND[cls.name]
        wait_until(
            lambda: first_after(tool.events(), kind, t_req) is not None, 30, f"{cls.name}: the stop"
        )
        stopped = first_after(tool.events(), kind, t_req)
        assert stopped is not None
        first_signal = float(sig.read_text().split()[1]) if sig.exists() else None
        child_alive = alive(child.pid, child.create_time())
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    return {
        "signal_to_stopped_s": stopped.t - first_signal if first_signal else None,
        "request_to_stopped_s": stopped.t - t_req,
        "child_alive_after_stop": child_alive,
    }


def measure_grandchild(cls: type[Tool], kind: str, tmp: Path) -> dict[str, Any]:
    """Does a grandchild (in the child's group, or detached by setsid) outlive a stop?"""
    root = tmp / f"{cls.name}-grandchild-{kind}"
    pid_file = root / "grandchild.pid"
    root.mkdir(parents=True, exist_ok=True)
    with running(cls, root, Program(py(PARENT, kind, str(pid_file)))) as tool:
        wait_until(pid_file.exists, 30, f"{cls.name}: the grandchild")
        gpid = int(pid_file.read_text())
        ctime = psutil.Process(gpid).create_time()
        t_req = time.time()
        tool.request_stop()
        stop_kind = STOP_KIND[cls.name]
        wait_until(
            lambda: first_after(tool.events(), stop_kind, t_req) is not None,
            30,
            f"{cls.name}: the stop",
        )
        deadline = time.monotonic() + 2
        while alive(gpid, ctime) and time.monotonic() < deadline:
            time.sleep(0.05)
        survived = alive(gpid, ctime)
    if survived:
        os.kill(gpid, signal.SIGKILL)
    return {"survived": survived}


def measure_idle(cls: type[Tool], seconds: float, cli_runs: int, tmp: Path) -> dict[str, Any]:
    """CPU and RSS with one sleeping child; then the tool's CLI asking for its status."""
    prog = Program(py(READY_SLEEPER), observe=False)
    with running(cls, tmp / f"{cls.name}-idle", prog) as tool:
        proc = psutil.Process(tool.supervisor_pid())
        wait_until(lambda: bool(proc.children()), 30, f"{cls.name}: the sleeping child")
        time.sleep(1.0)
        c0 = proc.cpu_times()
        time.sleep(seconds)
        c1 = proc.cpu_times()
        rss = proc.memory_info().rss / 2**20
        cli_s = time_command(*tool.status_command(), cli_runs)
    return {
        "cpu_pct": (c1.user + c1.system - c0.user - c0.system) / seconds * 100,
        "rss_mib": rss,
        "cli_status_s": cli_s,
    }


def time_command(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    """Wall times of `runs` runs of a command, start to exit (each must succeed)."""
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=True, stdin=subprocess.DEVNULL)
        walls.append(time.perf_counter() - t0)
    return walls


def measure_idle_unconfigured(seconds: float, tmp: Path) -> float:
    """gpuwarden's RSS with nothing to supervise: no default config, a fake 8-GPU host."""
    from gpuwarden.standin import fakegpu  # noqa: PLC0415

    root = tmp / "idle-unconfigured"
    fakegpu.init_dir(root / "fakegpu", fakegpu.DEFAULT_COUNT, fakegpu.DEFAULT_TOTAL_MIB, 0.0)
    prog = Program(
        py(SLEEPER),
        observe=False,
        gw_settings={"default_config": None, "gpu": {"backend": "fake"}},
        gw_env={fakegpu.ENV_DIR: str(root / "fakegpu")},
    )
    with running(Gpuwarden, root, prog) as tool:
        time.sleep(1.0 + seconds)
        return float(psutil.Process(tool.supervisor_pid()).memory_info().rss / 2**20)


# -- gpuwarden only ----------------------------------------------------------------------------

STAMP_SLEEPER = """
import sys, time
t = time.time()
with open(sys.argv[1], "a") as f:
    f.write(f"{t}\\n")
time.sleep(3600)
"""


def measure_gpu_freed(rounds: int, tmp: Path) -> dict[str, list[float]]:
    """A foreign holder keeps the fake GPU busy; it dies; how soon is the server exec'd?"""
    from gpuwarden.standin import fakegpu  # noqa: PLC0415

    root = tmp / "gpu-freed"
    fake = root / "fakegpu"
    fakegpu.init_dir(fake, 1, fakegpu.DEFAULT_TOTAL_MIB, 0.0)
    starts = root / "starts.txt"
    prog = Program(
        py(STAMP_SLEEPER, str(starts)),
        gw_settings={"gpu": {"backend": "fake"}},
        gw_config={"gpus": [0]},
        gw_env={fakegpu.ENV_DIR: str(fake)},
    )
    to_exec, to_first = [], []
    rng = random.Random(9)
    tool = Gpuwarden(root, prog)

    def hold() -> subprocess.Popen[bytes]:
        argv = [PY, "-m", "gpuwarden.api.cli", "fake-gpu", "hold", "--gpu", "0", "--mib"]
        h = subprocess.Popen([*argv, "100000", "--dir", str(fake)], stdout=subprocess.PIPE)
        assert h.stdout is not None
        h.stdout.readline()  # "pid N holds ..." once its holder file is written
        return h

    holder = hold()
    try:
        tool.start()
        for i in range(rounds):
            wait_until(
                lambda n=i + 1: (
                    sum(1 for _, r in tool.records() if r.get("event") == "server.gpu_wait") >= n
                ),
                30,
                "the GPU wait",
            )
            time.sleep(rng.uniform(0, 0.25))  # freed at any point of the daemon's poll
            holder.kill()
            holder.wait()
            t_free = time.time()
            launch = tool.wait_event("start", i + 1)[i]
            wait_until(lambda n=i + 1: len(stamps(starts)) >= n, 30, "the server's first line")
            to_exec.append(launch.t - t_free)
            to_first.append(stamps(starts)[i][0] - t_free)
            tool.request_stop()
            tool.wait_event("stopped", i + 1)
            holder = hold()
            tool._post("/start")
    finally:
        holder.kill()
        holder.wait()
        tool.close()
    return {"freed_to_exec_s": to_exec, "freed_to_first_instruction_s": to_first}


# -- the run and its table -----------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_ms(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x * 1000:.1f} ms"


def fmt_s(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.3f} s"


def ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or math.isnan(ours) or math.isnan(theirs) or not theirs:
        return "—"
    r = ours / theirs
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.1g}x"


def machine() -> dict[str, str]:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False)
    commit = subprocess.run(
        ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory_gib": f"{psutil.virtual_memory().total / 2**30:.0f}",
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
        "node": node.stdout.strip(),
        "commit": commit.stdout.strip() or "unknown",
    }


def run_all(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import restart  # noqa: PLC0415 - bench/restart.py (it imports this module)

    import api as control  # noqa: PLC0415 - bench/api.py (the name shadows nothing here)

    res: dict[str, Any] = {"machine": machine(), "versions": {}, "params": vars(args).copy()}
    res["params"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in res["params"].items()}

    def step(what: str) -> None:
        print(f"[bench] {what}", file=sys.stderr, flush=True)

    step(f"crash -> restart: each tool and the floor, {args.rounds} interleaved rounds")
    names = [cls.name for cls in TOOLS] + ["floor"]
    res["restart"] = restart.interleaved(names, args.rounds, tmp / "restart")
    step(f"each tool's defaults for {args.defaults_s:g} s, a child crashing 0.2 s after start")
    res["defaults"] = measure_defaults(args.defaults_s, tmp)
    res["capture"] = {}
    for mode in ("line", "buffered"):
        step(f"log capture, {args.lines} lines, {mode} writes, {args.reps} repetitions")
        runs: dict[str, list[dict[str, Any]]] = {"floor": []}
        for rep in range(args.reps):
            runs["floor"].append(measure_capture(None, args.lines, mode, tmp / f"c{rep}"))
            for cls in TOOLS:
                runs.setdefault(cls.name, []).append(
                    measure_capture(cls, args.lines, mode, tmp / f"c{rep}")
                )
        res["capture"][mode] = runs
    step(f"lines lost at the child's death: {args.loss_runs} more buffered runs per tool")
    res["loss"] = {"floor": []}
    for rep in range(args.loss_runs):
        for cls in TOOLS:
            run = measure_capture(cls, args.lines, "buffered", tmp / f"loss{rep}")
            res["loss"].setdefault(cls.name, []).append(args.lines - run["lines"])
    step("stop: a child ignoring the polite signal, 1 s timeout; grandchildren")
    res["stop"] = {
        cls.name: [measure_stop(cls, tmp, rep) for rep in range(args.reps)] for cls in TOOLS
    }
    res["grandchild"] = {
        cls.name: {kind: measure_grandchild(cls, kind, tmp) for kind in ("same", "detached")}
        for cls in TOOLS
    }
    step(f"idle, {args.idle_s:g} s with one sleeping child")
    res["idle"] = {cls.name: measure_idle(cls, args.idle_s, args.cli_runs, tmp) for cls in TOOLS}
    res["cli_floor_s"] = time_command([PY, "-c", "pass"], dict(os.environ), args.cli_runs)
    res["idle_unconfigured_rss_mib"] = measure_idle_unconfigured(args.idle_s, tmp)
    res["versions"] = {cls.name: tool_version(cls) for cls in TOOLS}
    step("gpuwarden only: ready line, GPU freed, /status under a flood, swaps")
    res["ready_s"] = core.bench_ready(args.rounds // 3, tmp)
    res["gpu_freed"] = measure_gpu_freed(args.rounds // 3, tmp)
    res["status"] = control.bench_status(tmp, args.status_s, 200.0)
    res["swap"] = control.bench_swap(tmp, args.swaps)
    return res


def tool_version(cls: type[Tool]) -> str:
    if cls is Gpuwarden:
        from importlib.metadata import version  # noqa: PLC0415

        return version("gpuwarden")
    if cls is Supervisord:
        out = subprocess.run(
            [str(SUPERVISORD), "--version"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    return str(json.loads((PM2_MODULE / "package.json").read_text())["version"])


PEER_NAMES = ["supervisord", "PM2"]


def render(res: dict[str, Any]) -> str:
    import restart  # noqa: PLC0415 - bench/restart.py (it imports this module)

    m, v, p = res["machine"], res["versions"], res["params"]
    rows: list[list[str]] = []

    def stat_row(
        label: str, values: dict[str, list[float]], fmt: Callable[..., str], q: float = 0.5
    ) -> None:
        """A row of one statistic per tool (the median, or the q-quantile) and the ratios."""
        x = {k: median(v) if q == 0.5 else core.pct(v, q) for k, v in values.items()}
        rows.append(
            [label, fmt(x.get("floor")), fmt(x["gpuwarden"])]
            + [fmt(x[n]) for n in PEER_NAMES]
            + [ratio(x["gpuwarden"], x[n]) for n in PEER_NAMES]
        )

    def plain(label: str, floor: str, cells: dict[str, str]) -> None:
        rows.append([label, floor, cells["gpuwarden"]] + [cells[n] for n in PEER_NAMES] + ["", ""])

    def spread_row(label: str, values: dict[str, list[float]]) -> None:
        """A row of `median (p25-p75)` per tool and the medians' ratios."""
        x = {k: median(v) for k, v in values.items()}
        rows.append(
            [label]
            + [restart.cell(values.get(n)) for n in ["floor", "gpuwarden", *PEER_NAMES]]
            + [ratio(x["gpuwarden"], x[n]) for n in PEER_NAMES]
        )

    r = res["restart"]
    gaps = {k: x["gap_s"] for k, x in r.items()}
    exits = {k: x["exit_s"] for k, x in r.items()}
    spread_row("crash → next start, each tool's minimum restart delay: median (p25-p75)", gaps)
    stat_row("  p95", gaps, fmt_ms, q=0.95)
    spread_row("exit → state change, as each tool reports it: median (p25-p75)", exits)
    stat_row("  p95", exits, fmt_ms, q=0.95)
    d = res["defaults"]
    plain(
        f"defaults, {p['defaults_s']:g} s of a child crashing 0.2 s after start: starts",
        "",
        {k: str(x["starts"]) for k, x in d.items()},
    )
    plain(
        "  then: state (last start at)",
        "",
        {
            k: f"{x['state']} ({x['last_start_s']:.1f} s)"
            if x["last_start_s"] is not None
            else x["state"]
            for k, x in d.items()
        },
    )
    for mode, runs in res["capture"].items():
        what = "one write per line" if mode == "line" else "64 KiB buffered writes"
        walls = {k: [x["wall_s"] for x in v] for k, v in runs.items()}
        stat_row(
            f"log capture, {p['lines']:,} lines of 80 B, {what}: child wall time "
            "(floor: to a file)",
            walls,
            fmt_s,
        )
        peaks = {k: [x["peak_rss_mib"] for x in v] for k, v in runs.items() if k != "floor"}
        rows.append(
            ["  supervisor peak RSS (VmHWM)", ""]
            + [f"{max(peaks[n]):.0f} MiB" for n in ["gpuwarden", *PEER_NAMES]]
            + [ratio(max(peaks["gpuwarden"]), max(peaks[n])) for n in PEER_NAMES]
        )
    # Every capture run counts for the loss row, and the extra runs made for it.
    lost: dict[str, list[int]] = {k: list(v) for k, v in res["loss"].items()}
    for by_tool in res["capture"].values():
        for name, tool_runs in by_tool.items():
            lost.setdefault(name, []).extend(p["lines"] - x["lines"] for x in tool_runs)

    def losses(values: list[int]) -> str:
        hit = [x for x in values if x]
        return f"{max(hit):,} lines ({len(hit)} of {len(values)} runs)" if hit else "0"

    plain(
        f"lines lost, the child SIGKILLed right after its last write of {p['lines']:,} "
        f"(worst run; runs with a loss)",
        losses(lost["floor"]),
        {k: losses(lost[k]) for k in ["gpuwarden", *PEER_NAMES]},
    )
    stops = {
        k: [x["signal_to_stopped_s"] for x in v if x["signal_to_stopped_s"]]
        for k, v in res["stop"].items()
    }
    stat_row(
        "stop, child ignoring TERM/INT, 1 s timeout: polite signal → stopped reported",
        stops,
        fmt_s,
    )
    plain(
        "  child still alive after the reported stop",
        "",
        {
            k: "yes" if any(x["child_alive_after_stop"] for x in v) else "no"
            for k, v in res["stop"].items()
        },
    )
    g = res["grandchild"]
    plain(
        "grandchild in the child's process group survives a stop",
        "",
        {k: "yes" if x["same"]["survived"] else "no" for k, x in g.items()},
    )
    plain(
        "grandchild detached by setsid + double fork survives a stop",
        "",
        {k: "yes" if x["detached"]["survived"] else "no" for k, x in g.items()},
    )
    idle = res["idle"]
    rows.append(
        ["idle, one sleeping child: RSS", ""]
        + [f"{idle[n]['rss_mib']:.1f} MiB" for n in ["gpuwarden", *PEER_NAMES]]
        + [ratio(idle["gpuwarden"]["rss_mib"], idle[n]["rss_mib"]) for n in PEER_NAMES]
    )
    plain(
        f"  CPU over {p['idle_s']:g} s",
        "",
        {n: f"{max(0.0, idle[n]['cpu_pct']):.2f} %" for n in ["gpuwarden", *PEER_NAMES]},
    )
    stat_row(
        f"CLI start: `gpuwarden status`, `supervisorctl status`, `pm2 status` against the idle "
        f"tool, start to exit (median of {p['cli_runs']}; floor: `python -c pass`)",
        {"floor": res["cli_floor_s"], **{n: idle[n]["cli_status_s"] for n in idle}},
        fmt_ms,
    )

    head = (
        "| measure | floor | gpuwarden | supervisord | PM2 | gpuwarden ÷ supervisord "
        "| gpuwarden ÷ PM2 |\n|---|---|---|---|---|---|---|\n"
    )
    table = head + "".join("| " + " | ".join(row) + " |\n" for row in rows)
    ready, freed = res["ready_s"], res["gpu_freed"]["freed_to_exec_s"]
    st, sw = res["status"], res["swap"]
    own = (
        "| gpuwarden only | median | p95 / max |\n|---|---|---|\n"
        f"| ready line → `ready` | {fmt_ms(median(ready))} | {fmt_ms(core.pct(ready, 0.95))} |\n"
        f"| fake GPU freed → next exec (GPU poll every 0.1 s while waiting) "
        f"| {fmt_ms(median(freed))} | {fmt_ms(core.pct(freed, 0.95))} |\n"
        f"| `/status` at {st['rate']:.0f} req/s while the server floods its log"
        f"{'' if st['still_flooding_at_end'] else ' (the flood ended early)'} (p50, p99) "
        f"| {fmt_ms(st['p50_s'])} | {fmt_ms(st['p99_s'])} |\n"
        f"| swap overhead beyond the old server's stop and the new one's start "
        f"| {fmt_ms(sw['overhead_p50_s'])} | {fmt_ms(sw['overhead_max_s'])} |\n"
        f"| idle RSS with nothing to supervise (no default config, fake 8-GPU host) "
        f"| {res['idle_unconfigured_rss_mib']:.1f} MiB | |\n"
    )
    header = (
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB, Linux "
        f"{m['kernel']}): gpuwarden {v['gpuwarden']} ({m['commit']}), "
        f"supervisord {v['supervisord']}, "
        f"PM2 {v['PM2']} on node {m['node']}, Python {m['python']}. {p['rounds']} interleaved "
        f"restart rounds, "
        f"{p['reps']} repetitions of the capture and stop runs. Ratios are gpuwarden's figure "
        "divided by the peer's: below 1 is faster or smaller. Reproduce with `make bench`.\n"
    )
    return header + "\n" + table + "\n" + own + "\n" + NOTES


NOTES = """\
How each tool was set up (`bench/peers.py` writes the files):
- **gpuwarden**: one config running the child (`preflight: {argv: false}`, a health URL that
  never answers, so the child stays `starting`); `restart: {initial_delay_s: 0, jitter: 0}`,
  `stop: {grace_s: 1}`. Its reports are its JSON records on stdout, timed as they arrive.
- **supervisord**: `[program:child]` with `autorestart=true`, `startsecs=0`,
  `startretries=1000000`, `stopwaitsecs=1`, stdout to a file without rotation; its reports come
  from an event listener subscribed to `PROCESS_STATE`. Its main loop wakes on output or once a
  second, which is where its ~1 s figures come from.
- **PM2**: an ecosystem file with `interpreter: none`, `restart_delay: 0`, `max_restarts:
  1000000`, `kill_timeout: 1000`; its reports come from its bus (`process:event`) through its own
  node module. It stops with SIGINT, so the stubborn child ignores INT as well as TERM.
- **defaults row**: nothing set but the command and the log files. gpuwarden waits 10 s, then
  doubles the wait (±20 %) and flags a crash loop after 3 failures in a row, retrying for ever;
  supervisord counts a start that dies within `startsecs=1` as failed, retries after 1, 2, 3 s
  and gives up (`FATAL`) after `startretries=3` such failures in a row (an exit it notices only
  after `startsecs`, on its once-a-second tick, counts as a good start, hence more starts than
  4); PM2 restarts at once and gives up (`errored`) after 16 restarts that each lived under
  `min_uptime` (1 s).
- **idle row**: the child prints SGLang's ready line and sleeps, so gpuwarden holds it `ready`
  and probes it no more than the config's liveness interval (an hour here, as the peers probe
  nothing; a real config probes `/health` every 5 s).
- **CLI start**: each tool's own command line asking the running tool (the idle row's) for its
  status, timed from exec to exit: `gpuwarden status --url`, `supervisorctl -s unix://...
  status`, `pm2 status`. The floor is the interpreter that two of the three start.
- **grandchildren**: supervisord signals only the child by default (`stopasgroup=false`); PM2
  kills the tree it finds under the child (`treekill`), which a setsid'd, double-forked
  grandchild has left; gpuwarden signals the group, and as the children's subreaper adopts and
  sweeps every descendant that was reparented to it.
- **restart rows**: the child notes its first instruction's time, then waits for SIGUSR1; on it
  it notes the time and exits 1. Each round ends one child of each tool in turn (the order
  rotates every round), waits for that tool's next start and its report of the exit, and lets it
  settle 50 ms, so drift on a shared machine lands on every tool alike (`bench/restart.py`;
  `make bench-repeat N=5` runs these rows alone, N times).
- **floor**: a bare `Popen`/`wait` loop restarting the same child (in a process of its own for
  the restart rows), and the child writing straight to a file.
"""

BEGIN, END = "<!-- bench:begin (written by bench/peers.py) -->", "<!-- bench:end -->"


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: the markers {BEGIN!r} ... {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="crash -> restart rounds per tool")
    ap.add_argument("--lines", type=int, default=500_000)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of capture and stop runs")
    ap.add_argument(
        "--loss-runs", type=int, default=7, help="extra buffered runs counted for lost lines"
    )
    ap.add_argument("--defaults-s", type=float, default=60.0)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--status-s", type=float, default=2.0)
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--cli-runs", type=int, default=21, help="runs of each tool's status CLI")
    ap.add_argument("--quick", action="store_true", help="small numbers: a smoke run")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "peers")
    ap.add_argument("--readme", type=Path, default=None, help="write the table into this file")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.lines, args.reps, args.defaults_s = 6, 50_000, 1, 5.0
        args.loss_runs = 1
        args.idle_s, args.status_s, args.swaps = 1.0, 0.5, 2
        args.cli_runs = 3
    for path, how in ((SUPERVISORD, "pip install supervisor"), (PM2_BIN, "npm install pm2")):
        if not path.exists():
            print(f"{path} is missing ({how} into {PEERS}; `make bench` does it)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        res = run_all(args, Path(tmp))
    table = render(res)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(table)
    if args.readme:
        update_readme(args.readme, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
