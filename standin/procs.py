"""The stand-in's child processes: one scheduler per TP rank and a detokenizer.

They are started with multiprocessing *spawn*, as SGLang's are, so this module and what it
imports keep their imports light. Each child first simulates its heavy imports, then arms
parent-death (PR_SET_PDEATHSIG, SIGKILL) and names itself with setproctitle, exactly in SGLang's
order: a parent that dies during the import window leaves an orphan that goes on to "load" onto
the GPU. This module holds the spawn targets; a rank's startup is `rankload`, its serving
`scheduler`.
"""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection

from . import fakegpu
from .childconfig import ChildConfig
from .childinit import arm_parent_death, set_title
from .failures import report_scheduler_exception
from .rankload import RankLoader
from .scheduler import Scheduler


def run_scheduler(rank: int, cfg: ChildConfig, conn: Connection) -> None:
    cfg.sleep("child_import")
    arm_parent_death()
    set_title("sglang::scheduler" if cfg.tp_size == 1 else f"sglang::scheduler_TP{rank}")
    loader = RankLoader(rank, cfg)
    try:
        info = loader.load()
        conn.send(info)
        Scheduler(rank, cfg, conn, loader.max_total_tokens).serve()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except Exception:
        report_scheduler_exception(loader.prefix)
    finally:
        if loader.fake_root is not None:
            fakegpu.remove_holder(loader.fake_root)


def run_detokenizer(cfg: ChildConfig, conn: Connection) -> None:
    cfg.sleep("child_import")
    arm_parent_death()
    set_title("sglang::detokenizer")
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        while True:
            msg = conn.recv()
            if msg[0] == "shutdown":
                return
