"""Event loops: uvloop where it is installed, plain asyncio otherwise."""

from __future__ import annotations

import asyncio

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency everywhere but Windows
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(coro):
    """asyncio.run on uvloop (when available)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
