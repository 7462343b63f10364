"""The root's link to one worker: its address, the control connection, and the root's side of
the control protocol spoken over it (probe, the link's timing, set-up with the slices, replies
checked against their schemas, the end of a session)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..errors import DllamaError, NetworkError, PeerClosed
from ..net import connect
from ..wire import InvalidMessage
from . import messages as M
from . import protocol as P
from .slices import tensor_bytes

BUSY_RETRY_S = 0.1  # a worker still closing its previous session answers "busy" for a moment


def parse_address(text: str, default_port: int = 9998) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise DllamaError(f"bad worker address {text!r}: expected HOST:PORT") from None


async def answers(address: tuple[str, int], secret) -> bool:
    """Whether a worker completes a handshake now (the probe connection is closed at once)."""
    try:
        conn = await connect(*address, role="control", secret=secret, connect_timeout=1.0)
    except NetworkError:
        return False
    await conn.close()
    return True


@dataclass
class WorkerLink:
    rank: int
    host: str
    port: int
    timeout: float = 30.0  # seconds a silent worker is given
    conn: object = None
    gmacs: float | None = None  # its measured speed (--weights auto)
    mem_available: int | None = None  # bytes it accepts for a slice and its KV cache
    ready: dict | None = None
    last_stats: dict | None = None  # its figures of the last step

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def name(self) -> str:
        return f"worker {self.rank} ({self.host}:{self.port})"

    async def open(self, *, session: str, secret, measure: bool, patience: float) -> None:
        """Connect and probe (its memory, and its speed if `measure`). A worker still closing its
        previous session answers "busy" (or hangs up) for a moment: tried again for `patience` s."""
        deadline = time.monotonic() + patience
        while True:
            self.conn = await connect(self.host, self.port, role="control", secret=secret, peer_rank=self.rank,
                                      timeout=self.timeout, heartbeat=self.timeout / 4, session=session,
                                      connect_timeout=min(self.timeout, 10.0), max_frame=P.MAX_SETUP)
            await self.conn.send_msg(P.PROBE, M.Probe(measure).to_wire())
            try:
                probed = await self.expect(P.PROBED, M.Probed, timeout=max(self.timeout, 60.0))
            except DllamaError as e:
                await self.conn.close()
                if ("busy" in str(e) or isinstance(e, PeerClosed)) and time.monotonic() < deadline:
                    await asyncio.sleep(BUSY_RETRY_S)
                    continue
                raise
            self.gmacs, self.mem_available = probed.gmacs, probed.mem_available
            return

    async def time_link(self, small_iters: int = 8, large_iters: int = 3) -> tuple[float, float]:
        """(alpha, beta) of the link to this worker: half the best round trip of a small ECHO (s per
        message), and the seconds per byte a large one adds (as the sync group calibrates its ring)."""
        async def best_round_trip(nbytes: int, iters: int) -> float:
            echo = M.Echo(bytes(nbytes)).to_wire()
            best = float("inf")
            for _ in range(iters):
                t0 = time.perf_counter()
                await self.conn.send_msg(P.ECHO, echo)
                await self.expect(P.ECHO, M.Echo)
                best = min(best, time.perf_counter() - t0)
            return best

        alpha = await best_round_trip(8, small_iters) / 2
        large = await best_round_trip(P.ECHO_BYTES, large_iters) / 2
        return alpha, max((large - alpha) / P.ECHO_BYTES, 1e-12)

    def renumber(self, rank: int) -> None:
        self.rank = rank
        self.conn.peer = self.conn.peer._replace(rank=rank)

    async def set_up(self, setup: M.Setup, manifest, bar) -> None:
        """SETUP, then the slices its cache lacks (in chunks, the progress bar told), until LOADED."""
        await self.conn.send_msg(P.SETUP, setup.to_wire())
        wanted = set((await self.expect(P.NEED, M.Need)).names)
        for entry, tensor in manifest:
            if entry.name not in wanted:
                bar.update(entry.nbytes)
                continue
            raw = tensor_bytes(tensor)
            for start, stop in P.chunks(entry.nbytes):
                await self.conn.send_array(raw[start:stop], kind=P.TENSOR)
                bar.update(stop - start)
        await self.expect(P.LOADED, M.Loaded, timeout=max(self.timeout, 120.0))

    async def expect(self, kind, schema, timeout: float | None = None):
        """The worker's next message, of `kind` (checked against `schema`); FAILED raises its error."""
        got, body = await self.conn.recv_msg((kind, P.FAILED), timeout=timeout or self.timeout)
        if got == P.FAILED.name:
            raise DllamaError(f"{self.name}: {M.decode(P.FAILED, M.Failed, body).error}")
        try:
            return M.decode(kind, schema, body)
        except InvalidMessage as e:
            raise DllamaError(f"{self.name}: {e}") from None

    async def end(self) -> None:
        """END the session (the worker waits for the next root) and close."""
        if self.conn is not None and not self.conn.closed:
            try:
                await self.conn.send_msg(P.END, {})
            except NetworkError:
                pass
            await self.conn.close()
