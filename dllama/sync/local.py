"""p ranks in this process, connected over loopback TCP (real sockets): for tests and benchmarks.

    async with local_cluster(4, algo="ring") as groups:
        await asyncio.gather(*(g.all_reduce(x[r]) for r, g in enumerate(groups)))
"""

from __future__ import annotations

import asyncio
import contextlib

from ..net import ConnectionInbox, Listener
from .group import DEFAULT_TIMEOUT
from .rendezvous import init_process_group, peers_of


@contextlib.asynccontextmanager
async def local_cluster(p: int, algo: str = "ring", *, host: str = "127.0.0.1", session: str = "local",
                        secret=None, timeout: float | None = DEFAULT_TIMEOUT, **kwargs):
    """Yield p ProcessGroups (ranks 0..p-1) connected over `host` in the running event loop.
    (No busy-polling: all ranks share this thread, a spinning rank would only wait for itself.)"""
    if p < 1:
        raise ValueError("a cluster needs at least one rank")
    inboxes = [ConnectionInbox() for _ in range(p)]
    listeners = []
    groups = []
    try:
        for inbox in inboxes:
            listeners.append(await Listener(peers_of(session, inbox), secret=secret, session=session).start(host, 0))
        addrs = [(host, lst.port) for lst in listeners]
        groups = await asyncio.gather(*(
            init_process_group(r, p, addrs, session=session, algo=algo, secret=secret, timeout=timeout,
                               incoming=inboxes[r], **{"spin": 0.0, **kwargs})
            for r in range(p)))
        yield list(groups)
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        await asyncio.gather(*(lst.close() for lst in listeners), return_exceptions=True)
