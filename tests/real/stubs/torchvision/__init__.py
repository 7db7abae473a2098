"""A torchvision whose every submodule and name exists and raises when used.

SGLang and transformers import torchvision at module level for image helpers only; PyPI's
torchvision for torch 2.13 is CUDA-linked and cannot be imported beside the CPU torch.
Text serving never calls it; if anything does, it fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+gpuwarden.test.stub"


class _Unavailable:
    """Any name of the stub: a class to subclass, a function to call; using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test stub: torchvision is not installed here")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if attr[:1].islower():
            try:
                return importlib.import_module(full)
            except ImportError:
                pass
        return _Unavailable(full)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


import importlib  # noqa: E402

sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
