"""Links that behave like a LAN, for tests and benchmarks (not the product): this kernel has no
netem, so a TCP relay in user space delays each direction by a one-way latency and paces it to a
bandwidth. A node reached through a relay (the root's and the other workers' links to it: they dial
the address the root was given) then pays what Ethernet (0.2-0.5 ms one way) or Wi-Fi (2-5 ms)
costs per round trip.

Each direction models a link: bytes leave at the link's rate after those before them (serialization),
and arrive `one_way_s` later (propagation); the relay keeps reading meanwhile, so pipelined messages
overlap as on a wire. Its own cost (a few tens of microseconds a hop in Python) comes on top.

    with RelayThread([("127.0.0.1", 9998)], one_way_s=0.0005) as relays:
        relays.addresses  # ["127.0.0.1:<port>"]: give these to --workers
"""

from __future__ import annotations

import asyncio
import signal
import threading

CHUNK = 1 << 16


class Relay:
    """Listens on `host` (127.0.0.1; port 0: any free one) and forwards every connection to `target`."""

    def __init__(self, target: tuple[str, int], one_way_s: float, bytes_per_s: float | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.target, self.one_way_s, self.bytes_per_s = target, one_way_s, bytes_per_s
        self.host, self.port = host, port
        self.server: asyncio.AbstractServer | None = None
        self.bytes = 0  # forwarded, both directions
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "Relay":
        self.server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._direction(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Read as it comes; deliver each chunk when the link would: after the chunks before it are
        sent at the link's rate, one latency later."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if data is None:
                    break
                dst.write(data)
                await dst.drain()
            dst.close()

        delivering = asyncio.ensure_future(deliver())
        link_free = 0.0  # when the link has sent what it was given
        try:
            while data := await src.read(CHUNK):
                self.bytes += len(data)
                sent = max(loop.time(), link_free)
                if self.bytes_per_s:
                    sent += len(data) / self.bytes_per_s
                link_free = sent
                queue.put_nowait((sent + self.one_way_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((max(loop.time(), link_free) + self.one_way_s, None))  # then close, in order
            try:
                await delivering
            except (ConnectionError, OSError):
                pass


class RelayThread:
    """Relays to `targets` on a loop of their own (in a thread): tests and benchmarks drive the
    nodes as processes, and the relays must keep time whatever the caller's loop is doing."""

    def __init__(self, targets: list[tuple[str, int]], one_way_s: float, bytes_per_s: float | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relays = [self._call(Relay(t, one_way_s, bytes_per_s).start()) for t in targets]

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{relay.port}" for relay in self.relays]

    def close(self) -> None:
        for relay in self.relays:
            self._call(relay.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> "RelayThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _serve(listen: str, target: str, one_way_ms: float, mbit_per_s: float | None) -> None:
    host, port = listen.rsplit(":", 1)
    target_host, target_port = target.rsplit(":", 1)
    relay = await Relay((target_host, int(target_port)), one_way_ms / 1e3,
                        None if mbit_per_s is None else mbit_per_s * 1e6 / 8, host, int(port)).start()
    print(f"relaying {relay.host}:{relay.port} to {target}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await relay.close()


if __name__ == "__main__":  # a relay as a process of its own (in a network namespace: tests/home_cluster.py)
    import argparse

    parser = argparse.ArgumentParser(description="A TCP relay that delays each direction (and paces it).")
    parser.add_argument("listen", help="HOST:PORT to listen on")
    parser.add_argument("target", help="HOST:PORT to forward to")
    parser.add_argument("--one-way-ms", type=float, default=0.0)
    parser.add_argument("--mbit", type=float, default=None, help="pace each direction to this rate")
    args = parser.parse_args()
    asyncio.run(_serve(args.listen, args.target, args.one_way_ms, args.mbit))
