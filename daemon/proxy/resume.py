"""Continuing a stream cut by a dead server on the next one (`proxy.continue_streams`)."""

from __future__ import annotations

from typing import Any


class Resumer:
    def __init__(self, gate: Any) -> None:
        self.gate = gate
