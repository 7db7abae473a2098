"""The control plane's routes, read from its routers (no request is made here)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

import gpuwarden.api
from gpuwarden.api import auth


def _routers() -> Iterator[APIRouter]:
    """Every router in the control plane's package, so a new routes module is covered too."""
    for info in pkgutil.iter_modules(gpuwarden.api.__path__):
        module = importlib.import_module(f"gpuwarden.api.{info.name}")
        yield from (v for v in vars(module).values() if isinstance(v, APIRouter))


def _calls(dependant: Dependant) -> Iterator[Any]:
    yield dependant.call
    for sub in dependant.dependencies:
        yield from _calls(sub)


def _on_the_loop(call: Any) -> bool:
    """FastAPI awaits a coroutine function, or an object whose `__call__` is one, in the loop;
    anything else goes to its thread pool."""
    if call is None or inspect.iscoroutinefunction(call):
        return True
    return inspect.iscoroutinefunction(getattr(call, "__call__", None))  # noqa: B004


def test_no_route_hops_to_the_thread_pool() -> None:
    """A plain-function endpoint or dependency runs on FastAPI's thread pool. While the loop
    is kept busy (a server flooding its log), that hop waits for the GIL, a switch interval
    (5 ms) at a time, on every request: /status's p99 went from ~9 ms to ~3 ms without it."""
    routes = [route for router in _routers() for route in router.routes]
    routes = [route for route in routes if isinstance(route, APIRoute)]
    assert {"/status", "/restart", "/logs"} <= {r.path for r in routes}
    hops = {
        f"{sorted(r.methods or ())} {r.path}: {getattr(call, '__qualname__', call)!r}"
        for r in routes
        for call in _calls(r.dependant)
        if not _on_the_loop(call)
    }
    assert _on_the_loop(auth.bearer)  # the routers' own dependency, when a token is set
    assert not hops, sorted(hops)
