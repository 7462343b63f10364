"""tests/lan_relay.py, the emulated LAN links of the speculation tests and benchmarks: every byte
arrives, in order, and never sooner than the link's latency and rate allow."""

from __future__ import annotations

import os
import socket
import threading
import time

from .lan_relay import RelayThread


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _round_trip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = address.split(":")
    with socket.create_connection((host, int(port))) as conn:
        t0 = time.perf_counter()
        conn.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += conn.recv(1 << 16)
        return got, time.perf_counter() - t0


def test_a_relay_delays_each_direction_and_paces_it():
    server, port = _echo_server()
    try:
        with RelayThread([("127.0.0.1", port)], one_way_s=0.02) as relays:
            for _ in range(3):
                got, seconds = _round_trip(relays.addresses[0], b"ping")
                assert got == b"ping" and seconds >= 0.04  # a latency each way
            payload = os.urandom(3 << 20)  # many chunks, in order
            got, _ = _round_trip(relays.addresses[0], payload)
            assert got == payload
        with RelayThread([("127.0.0.1", port)], one_way_s=0.0, bytes_per_s=2e6) as relays:
            got, seconds = _round_trip(relays.addresses[0], payload[:500_000])
            assert got == payload[:500_000] and seconds >= 0.25  # 0.25 s at 2 MB/s (the echo overlaps it)
    finally:
        server.close()
