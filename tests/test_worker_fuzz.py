"""Fuzz a worker daemon: 10,000+ random and mutated frames over real sockets, then check the worker
still serves a root, did not grow its memory, and never crashed."""

from __future__ import annotations

import asyncio
import os
import random

import msgpack
import pytest

from dllama.net.frames import HEADER, KINDS, MAGIC, PROTOCOL_VERSION, pack_msg

from .cluster_helpers import WorkerProcess, run_dllama

N_FRAMES = 10_000
SECRET = "fuzz-secret"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _frame(rng: random.Random) -> bytes:
    """One hostile frame: garbage, a valid header with a lying length or an unknown kind, a
    truncated or oversized body, or a well-formed message with nonsense inside."""
    codes = [k.code for k in KINDS]
    choice = rng.randrange(7)
    if choice == 0:  # pure noise
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 1:  # valid header, any kind code, huge or wrong length, short body
        length = rng.choice([0, 1, 15, 4096, 1 << 20, (1 << 32) - 1, rng.randrange(1 << 32)])
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.randrange(256), 0, rng.randrange(1 << 32), length) + \
            rng.randbytes(rng.randrange(0, 32))
    if choice == 2:  # a known kind with a random msgpack-ish body
        body = rng.randbytes(rng.randrange(0, 200))
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body
    if choice == 3:  # a plausible message with wrong types, extra fields, deep nesting
        body = pack_msg({"proto": rng.choice([PROTOCOL_VERSION, 0, "x", None]), "role": rng.choice(["control", "peer", 7]),
                         "rank": rng.choice([0, -1, 2 ** 40, "r"]), "session": rng.randbytes(4).hex(),
                         "nonce": rng.randbytes(rng.choice([0, 16, 100])), "n": [[[[]]]] * rng.randrange(5)})
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body
    if choice == 4:  # wrong magic or version
        body = msgpack.packb({"a": 1})
        return HEADER.pack(rng.randbytes(4), rng.randrange(256), rng.choice(codes), 0, 0, len(body)) + body
    if choice == 5:  # a valid frame with one flipped byte
        body = pack_msg({"proto": PROTOCOL_VERSION, "role": "control", "rank": None, "session": "s",
                         "nonce": b"n" * 16})
        raw = bytearray(HEADER.pack(MAGIC, PROTOCOL_VERSION, KINDS.get("hello").code, 0, 0, len(body)) + body)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    # msgpack ext types and huge declared containers inside a small body
    body = rng.choice([b"\xc7\x01\x05x", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xf0"])
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, rng.choice(codes), 0, 0, len(body)) + body


async def _fuzz(port: int, seed: int) -> int:
    rng = random.Random(seed)
    sent = 0

    async def one_connection():
        nonlocal sent
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        except OSError:
            return
        try:
            for _ in range(rng.randrange(1, 40)):
                writer.write(_frame(rng))
                sent += 1
            await asyncio.wait_for(writer.drain(), 5)
            # read whatever the worker says (a REJECT) until it hangs up, briefly
            await asyncio.wait_for(reader.read(65536), 0.5)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    while sent < N_FRAMES:
        await asyncio.gather(*(one_connection() for _ in range(8)))
    return sent


def test_worker_survives_fuzzed_frames_and_still_serves_a_root():
    worker = WorkerProcess("--no-cache", "--secret", SECRET, "--timeout", "5")
    try:
        warm = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--workers", worker.address,
                          "--secret", SECRET, "--json")
        assert warm.returncode == 0, warm.stderr
        rss_before = _rss_mb(worker.proc.pid)
        sent = asyncio.run(_fuzz(worker.port, seed=int.from_bytes(os.urandom(2), "little")))
        assert sent >= N_FRAMES
        assert worker.proc.poll() is None, "the worker died under fuzzing"
        rss_after = _rss_mb(worker.proc.pid)
        assert rss_after < rss_before + 64, f"RSS grew from {rss_before:.0f} to {rss_after:.0f} MB"
        r = run_dllama("inference", "-p", "The capital of France is", "-n", "8", "--temperature", "0",
                       "--threads", "1", "--workers", worker.address, "--secret", SECRET, "--json")
        assert r.returncode == 0, r.stderr
    finally:
        log = worker.stop()
    assert "Traceback" not in log, log[-3000:]
    print(f"\n{sent} fuzzed frames; worker RSS {rss_before:.0f} -> {rss_after:.0f} MB")


@pytest.mark.parametrize("payload", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 100_000])
def test_worker_rejects_non_protocol_clients(payload):
    worker = WorkerProcess("--no-cache")
    try:
        async def poke():
            reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
            writer.write(payload)
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(), 12)  # the worker hangs up (handshake timeout at most)
            finally:
                writer.close()

        asyncio.run(poke())
        assert worker.proc.poll() is None
        r = run_dllama("inference", "-p", "hi", "-n", "2", "--threads", "1", "--workers", worker.address, "--json")
        assert r.returncode == 0, r.stderr
    finally:
        worker.stop()
