"""The environment `make test-real` runs the real SGLang in: built once, then reused.

    python tests/real/env.py          # build it if needed; the last line printed is its path
    python tests/real/env.py --where  # only print where it is (or would be)

A virtual environment with torch 2.13.0 (this machine image's CPU wheel, never a CUDA
download), SGLang 0.5.23 installed with --no-deps and its CPU dependencies from
`requirements.lock`, and the tiny model `make_model.py` builds. It lives in
`${XDG_CACHE_HOME:-~/.cache}/gpuwarden/test-real/<hash>` (the root overridable with
GPUWARDEN_TEST_REAL_CACHE), the hash taken over what defines it: the pins below, `LAYOUT` (bump
it when the build steps change), `requirements.lock`, `make_model.py` and the Python that runs
this. A change to any of them builds a new one. It is a cache, never an input: delete it and
the next run builds it again. The import stubs under `stubs/` stay in the repository and go on
the SGLang processes' PYTHONPATH.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
TORCH = "torch==2.13.0"
SGLANG = "sglang==0.5.23"
# What defines the environment: its hash is taken over these (and the Python it runs).
LAYOUT = 1
DEFINING = ["requirements.lock", "make_model.py"]
STAMP = ".complete"


def cache_root() -> Path:
    if os.environ.get("GPUWARDEN_TEST_REAL_CACHE"):
        return Path(os.environ["GPUWARDEN_TEST_REAL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuwarden" / "test-real"


def defining_hash() -> str:
    h = hashlib.sha256()
    h.update(f"{LAYOUT} {sys.version_info[:2]} {platform.machine()} {TORCH} {SGLANG}\n".encode())
    for name in DEFINING:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def env_dir() -> Path:
    return cache_root() / defining_hash()


def is_complete(path: Path) -> bool:
    return (path / STAMP).is_file()


def python_of(path: Path) -> Path:
    return path / "bin" / "python"


def model_of(path: Path) -> Path:
    return path / "model"


def _say(msg: str) -> None:
    print(f"test-real env: {msg}", file=sys.stderr, flush=True)


def _pip(py: Path, *args: str) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", *args]
    _say(" ".join(["pip", *args]))
    subprocess.run(cmd, check=True)


class EnvError(Exception):
    pass


def _check_cpu_torch(py: Path, constraints: Path) -> None:
    """torch==2.13.0 must be the image's +cpu wheel: letting pip pick a CUDA build would
    download several GB and then fail on this machine anyway."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "--disable-pip-version-check",
                "install",
                "--quiet",
                "--dry-run",
                "--no-deps",
                "--ignore-installed",
                "-c",
                str(constraints),
                "--report",
                str(report),
                TORCH,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise EnvError(f"pip cannot resolve {TORCH}: {proc.stderr.strip()[-600:]}")
        install = json.loads(report.read_text())["install"]
    got = install[0]["metadata"]["version"] if install else "nothing"
    url = install[0].get("download_info", {}).get("url", "?") if install else "?"
    if "+cpu" not in got:
        raise EnvError(
            f"{TORCH} resolves to {got} ({url}), not a +cpu build. make test-real runs on the "
            "CPU and uses the CPU wheel of torch 2.13.0 that this machine image keeps on disk "
            "(found through pip's configuration: find-links); without it pip would download "
            "CUDA wheels of several GB. Refusing."
        )
    _say(f"{TORCH} resolves to {got} ({url})")


def build(path: Path) -> None:
    started = time.monotonic()
    if path.exists():
        _say(f"removing an unfinished environment at {path}")
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _say(f"building {path}")
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = python_of(path)
    constraints = path / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    _check_cpu_torch(py, constraints)
    _pip(py, "install", "--quiet", "-c", str(constraints), TORCH)
    _pip(py, "install", "--quiet", "-c", str(constraints), "-r", str(HERE / "requirements.lock"))
    _pip(py, "install", "--quiet", "--no-deps", SGLANG)
    _say("building the tiny model")
    subprocess.run([str(py), str(HERE / "make_model.py"), str(model_of(path))], check=True)
    info = {
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - started, 1),
        "python": platform.python_version(),
    }
    (path / STAMP).write_text(json.dumps(info) + "\n")
    _say(f"built in {info['seconds']} s")


def ensure() -> Path:
    path = env_dir()
    if is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: the second waits, then reuses
        if not is_complete(path):
            build(path)
    return path


def main() -> int:
    if sys.argv[1:] == ["--where"]:
        print(env_dir())
        return 0
    try:
        path = ensure()
    except EnvError as exc:
        print(f"make test-real: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:
        print(f"make test-real: the environment could not be built: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
