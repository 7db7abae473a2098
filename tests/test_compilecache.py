"""The JIT and compile caches every launch gets: one folder per (GPU model, SGLang version,
torch version), reused across launches, left alone where a config sets its own, measured and
pruned (the least recently used first, never the one in use)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from gpuwarden.daemon.compilecache import CACHE_VARS, USED_MARK, CompileCaches, folder_name
from gpuwarden.daemon.settings import CompileCacheSettings

from .support.configs import standin_config
from .support.daemon import start_daemon
from .support.procs import Proc, wait_until


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in raw if b"=" in e)


def test_every_launch_gets_the_same_folder_and_the_second_compiles_nothing(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    cfg = standin_config("--standin-deepgemm", scale=0.2)
    d = start_daemon(procs, tmp_path, fake_gpu, {"fp8": cfg}, default="fp8")
    d.wait_state("ready")
    first = d.status()
    env = _environ(first["pid"])
    folder = tmp_path / "cache" / "fake-gpu_sglang-unknown_torch-unknown"
    assert env["SGLANG_CACHE_DIR"] == str(folder)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert env["SGLANG_DG_CACHE_DIR"] == env["DG_JIT_CACHE_DIR"] == str(folder / "deep_gemm")
    assert set(CACHE_VARS) <= set(env)
    log = Path(first["log_file"]).read_text()
    assert "Try DeepGEMM JIT Compiling" in log  # a cold cache: its kernels compiled
    # A crash: the next launch finds them where the first left them.
    mark = d.mark()
    os.kill(first["pid"], signal.SIGKILL)
    d.wait_state("ready", after=mark, timeout=60)
    second = d.status()
    assert second["launch_id"] != first["launch_id"]
    assert _environ(second["pid"])["SGLANG_CACHE_DIR"] == str(folder)
    assert "Try DeepGEMM JIT Compiling" not in Path(second["log_file"]).read_text()
    # Its size in /status, once read after the launch was ready.
    wait_until(lambda: d.status()["compile_cache"]["folders"], 20, "the folders' sizes")
    [shown] = d.status()["compile_cache"]["folders"]
    assert shown["name"] == folder.name and shown["in_use"] and shown["bytes"] >= 65536


def test_a_config_that_sets_a_cache_variable_keeps_its_own_and_gets_none_of_ours(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    own = tmp_path / "own-triton"
    cfg = standin_config(env={"TRITON_CACHE_DIR": str(own), "CUDA_VISIBLE_DEVICES": "0"})
    d = start_daemon(procs, tmp_path, fake_gpu, {"own": cfg}, default="own")
    d.wait_state("ready")
    env = _environ(d.status()["pid"])
    assert env["TRITON_CACHE_DIR"] == str(own)
    assert not {"SGLANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} & set(env)


def _dist(site: Path, name: str, version: str) -> Path:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return info


async def test_the_folder_is_named_by_the_servers_own_versions_asked_again_after_an_upgrade(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    _dist(site, "sglang", "0.5.23")
    _dist(site, "torch", "2.13.0+cpu")
    caches = CompileCaches(
        CompileCacheSettings(dir=tmp_path / "cache"), lambda gpus: "NVIDIA H100 80GB HBM3"
    )
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", "m"]
    env = {**os.environ, "PYTHONPATH": str(site)}
    assert not caches.known(argv, env)
    await caches.learn(argv, env)
    assert caches.known(argv, env)
    folder = tmp_path / "cache" / "nvidia-h100-80gb-hbm3_sglang-0.5.23_torch-2.13.0+cpu"
    assert caches.env_for(argv, env, ["0"])["SGLANG_CACHE_DIR"] == str(folder)
    assert (folder / USED_MARK).is_file()
    # `pip install -U sglang`: its metadata folder changed; asked again, a folder of its own.
    (site / "sglang-0.5.23.dist-info").rename(site / "sglang-0.5.24.dist-info")
    (site / "sglang-0.5.24.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n"
    )
    assert not caches.known(argv, env)
    await caches.learn(argv, env)
    assert caches.env_for(argv, env, None)["SGLANG_CACHE_DIR"].endswith(
        "_sglang-0.5.24_torch-2.13.0+cpu"
    )
    # `python script.py` is asked too; not a Python: nothing to ask, and its folder says so.
    assert caches.interpreter([sys.executable, "serve.py"], env) == sys.executable
    assert caches.known(["/bin/true"], env)
    assert folder_name(None, None) == "no-gpu_sglang-unknown_torch-unknown"


async def test_pruning_drops_the_least_recently_used_past_the_bounds_never_the_one_in_use(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cache"
    caches = CompileCaches(CompileCacheSettings(dir=root, keep=3, max_bytes=10_000), lambda g: None)
    names = [f"gpu_sglang-0.5.{i}_torch-2.13.0" for i in range(5)]
    for i, name in enumerate(names):
        (root / name).mkdir(parents=True)
        (root / name / "k.bin").write_bytes(b"x" * 3000)
        (root / name / USED_MARK).touch()
        os.utime(root / name / USED_MARK, ns=(0, (1_000 + i) * 10**9))
    os.utime(root / names[0] / USED_MARK, ns=(0, 999 * 10**9))  # the oldest, but in use
    caches.in_use = names[0]
    # What gpuwarden did not make is neither counted nor removed: another program's folder,
    # one named like ours without the mark, a link.
    (root / "huggingface").mkdir()
    (root / "huggingface" / "model.bin").write_bytes(b"x" * 50_000)
    (root / "gpu_sglang-9_torch-9").mkdir()
    (root / "gpu_sglang-8_torch-8").symlink_to(root / "huggingface")
    shown = await caches.scan_and_prune()
    # Three kept (the bound), 9000 bytes (under 10 000): the newest two and the one in use.
    assert [f["name"] for f in shown] == [names[4], names[3], names[0]]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [
            names[0],
            names[3],
            names[4],
            "huggingface",
            "gpu_sglang-9_torch-9",
            "gpu_sglang-8_torch-8",
        ]
    )
    assert (root / "huggingface" / "model.bin").stat().st_size == 50_000
    assert [f["in_use"] for f in shown] == [False, False, True]
    view = caches.view()
    assert view["bytes"] == sum(f["bytes"] for f in shown) >= 9000
    # Past max_bytes alone, too.
    caches.settings = CompileCacheSettings(dir=root, keep=8, max_bytes=7000)
    assert [f["name"] for f in await caches.scan_and_prune()] == [names[4], names[0]]
    # An adopted server's folder (from its environment) is in use as well.
    caches.adopted({"SGLANG_CACHE_DIR": str(root / names[4])})
    assert caches.in_use == names[4]
    caches.adopted({"SGLANG_CACHE_DIR": str(tmp_path / "elsewhere")})
    assert caches.in_use == names[4]
