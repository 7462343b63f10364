"""Where a node's steps run. One threading model on every node: a node computes on the thread that
runs its network loop, so a step's sync points are awaited where the kernels run (no thread hop per
layer). A worker's main loop is that thread. The root's engine runs its own (`ComputeThread`): the
front end (the API server, chat) hands it each step and its own loop stays responsive meanwhile. A
model run alone under `inference` or `chat`, with nothing to answer during a step, computes on the
caller's loop instead (`CallerCompute`): the hop to another thread and back cost 0.5-1 ms a decode step.

A model run alone on its compute thread can be preempted: a step asked for with `preempt=True` (the
batcher's: a prompt that arrives while others decode) runs at once, while the step in flight waits at
its next sync point (`Preemption`), and that one then carries on. Steps touch separate KV cache slots,
and each kernel sums a token's values in one order whatever else runs, so neither step's bits change.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numba

from .net.loop import new_event_loop


class ComputeThread:
    """The root's compute thread: its own event loop, on which the engine's steps (and a cluster's
    connections) run. Always the same thread: OpenMP keeps a team of workers per calling thread,
    and numba's thread count is per calling thread (the creator's is handed over)."""

    def __init__(self):
        self.loop = new_event_loop()
        self._stopping = False
        threads = numba.get_num_threads()
        self._thread = threading.Thread(target=self._main, args=(threads,), name="dllama-compute", daemon=True)
        self._thread.start()

    def _main(self, threads: int) -> None:
        numba.set_num_threads(threads)
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def run(self, coroutine, preemption: Preemption | None = None):
        """Await `coroutine` on the compute loop; cancelling the wait cancels it there. With
        `preemption`, it is counted in there until done: the step in flight waits for it."""
        if self.stopped:
            coroutine.close()
            raise RuntimeError("the engine is closed")
        if preemption is not None:
            preemption.enter()
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        if preemption is not None:  # (once, however it ends: done, failed or cancelled before it ran)
            future.add_done_callback(lambda _: preemption.leave())
        return await asyncio.wrap_future(future)

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive() or self._stopping

    def stop(self) -> None:
        if not self.stopped:
            self._stopping = True
            self.loop.call_soon_threadsafe(self.loop.stop)


class Preemption:
    """Steps that preempt the one in flight on a node alone. The front end counts such a step in
    before handing it to the compute loop and out once it is done (or cancelled); the step in
    flight, at each of its sync points, yields the compute loop while any is counted in. The
    preempting step itself runs through a NodeStep without this, from start to end."""

    def __init__(self):
        self._lock = threading.Lock()  # (counted in on the front end's thread, out on either)
        self._count = 0
        self.paused_s = 0.0  # time steps in flight spent waiting here (not their compute)

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1

    async def wait(self) -> None:
        """On the compute loop, at a sync point: let the preempting steps run first."""
        if self._count:
            t0 = time.perf_counter()
            while self._count:  # (the preempting step may still be on its way to this loop)
                await asyncio.sleep(0)
            self.paused_s += time.perf_counter() - t0


class CallerCompute:
    """ComputeThread's stand-in for a model run alone on the caller's own loop: each step is awaited
    where it is asked for, with no hop to another thread and back."""

    def __init__(self):
        self._stopping = False

    async def run(self, coroutine):
        if self._stopping:
            coroutine.close()
            raise RuntimeError("the engine is closed")
        return await coroutine

    @property
    def stopped(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        self._stopping = True
