"""What the planner needs of a cluster, measured before any slice is sent: every node's matmul rate
(the workers' probes all at the same time, so workers that share a machine share its cores in the
figures; then the root's own), the memory each admits, and the slowest link's cost per message and
per byte (the root's ECHO round trips, as `--sync-mode auto` times them)."""

from __future__ import annotations

import asyncio
import uuid

from ..errors import DllamaError
from ..node import measure_speed, mem_available
from ..planner import NodeFigures
from ..sync_config import LinkFigures
from .link import WorkerLink, parse_address
from .sync_mode import time_links


async def survey(addresses: list[str], secret: str | None, timeout: float = 30.0) -> tuple[list[NodeFigures], LinkFigures]:
    """(the root's figures, then each worker's; the slowest link) of the workers at `addresses`."""
    links = [WorkerLink(i + 1, *parse_address(a), timeout) for i, a in enumerate(addresses)]
    session = uuid.uuid4().hex[:12]
    try:
        opened = await asyncio.gather(*(w.open(session=session, secret=secret, measure=True, patience=timeout)
                                        for w in links), return_exceptions=True)
        for w, result in zip(links, opened):
            if isinstance(result, BaseException):
                raise result if isinstance(result, DllamaError) else DllamaError(f"{w.name}: {result}")
        # the root's own once they are done: while they compile their probe's kernel, a root with a thread
        # per core measured up to 100x less (OpenMP's barriers spin on an oversubscribed machine)
        root_rate = await asyncio.to_thread(measure_speed)
        link = await time_links(links)
    finally:
        for w in links:
            await w.end()
    figures = [NodeFigures.of("the root", root_rate, mem_available())]
    figures += [NodeFigures.of(w.name, w.gmacs, w.mem_available) for w in links]
    return figures, link
