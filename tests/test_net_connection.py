"""Framed connections over real loopback sockets: messages, arrays, limits, liveness, shutdown."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from dllama.errors import MalformedFrame, PeerAborted, PeerClosed, PeerTimeout, PeerUnreachable, ProtocolError
from dllama.net import ARRAY, KINDS, RAW, Listener, as_bytes_view, connect, register_kind


@pytest.fixture
async def pair():
    """A connected (client, server) pair of Connections over loopback."""
    accepted = asyncio.get_running_loop().create_future()
    listener = await Listener(lambda conn, hello: accepted.set_result(conn)).start("127.0.0.1", 0)
    client = await connect("127.0.0.1", listener.port, rank=1, peer_rank=0)
    server = await accepted
    yield client, server
    await client.close()
    await server.close()
    await listener.close()


async def test_messages_and_arrays_roundtrip(pair):
    client, server = pair
    await client.send_msg("message", {"op": "load", "layers": [1, 2], "blob": b"\x00\xff"})
    assert await server.recv_msg() == ("message", {"op": "load", "layers": [1, 2], "blob": b"\x00\xff"})
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    await server.send_array(x)
    into = np.empty_like(x)
    assert await client.recv_array(into=into) is into and np.array_equal(into, x)
    await server.send_array(np.arange(7, dtype=np.int64))
    got = await client.recv_array(dtype=np.int64, max_len=1024)
    assert got.dtype == np.int64 and got.tolist() == list(range(7))
    assert client.bytes_recv > 0 and server.bytes_sent == client.bytes_recv


async def test_large_payload_lands_in_place(pair):
    """Tens of MB (a weight slice): straight into the posted buffer, even when the frame started
    arriving before the receive was posted."""
    client, server = pair
    big = np.random.default_rng(0).integers(0, 255, 40 << 20, dtype=np.uint8)
    into = np.zeros_like(big)
    send = asyncio.ensure_future(server.send_array(big))
    t_end = time.monotonic() + 10
    while client.bytes_recv < (1 << 20) and time.monotonic() < t_end:
        await asyncio.sleep(0.0005)
    assert 0 < client.bytes_recv < big.nbytes, "the frame should be partly received before we post"
    await client.recv_array(into=into)
    await send
    assert np.array_equal(into, big)


async def test_application_kinds_and_limits(pair):
    client, server = pair
    weights = register_kind("test_weights", 200, RAW, max_len=1 << 20)
    register_kind("test_weights", 200, RAW, max_len=1 << 20)  # same definition twice is fine
    with pytest.raises(ValueError, match="clashes"):
        register_kind("test_other", 200, RAW)
    with pytest.raises(ValueError, match="reserved"):
        register_kind("test_low", 20, RAW)
    await client.send_bytes(b"abc" * 10, kind="test_weights")
    assert bytes(await server.recv_bytes(kind=weights)) == b"abc" * 10
    with pytest.raises(ValueError, match="exceeds the limit"):
        client.write_frame(weights, bytes(2 << 20))
    assert KINDS.get(200) is weights


async def test_wrong_kind_and_wrong_size_are_protocol_errors(pair):
    client, server = pair
    await client.send_msg("message", {"a": 1})
    with pytest.raises(ProtocolError, match="message frame where a array frame"):
        await server.recv_array(into=np.empty(3, np.float32))
    assert server.closed


async def test_size_mismatch_names_peer(pair):
    client, server = pair
    await client.send_array(np.zeros(5, np.float32))
    with pytest.raises(MalformedFrame, match=r"rank 1 \(127\.0\.0\.1:\d+\).*20-byte array frame, expected 16"):
        await server.recv_array(into=np.empty(4, np.float32))


async def test_recv_timeout_keeps_connection_usable(pair):
    client, server = pair
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match=r"rank 0 .*no reply within 0\.2"):
        await client.recv_msg(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 1.5
    await server.send_msg("message", {"late": True})
    assert await client.recv_msg(timeout=2) == ("message", {"late": True})


async def test_silent_peer_times_out(pair):
    """A peer that sends nothing (no heartbeats) while we wait on it: PeerTimeout after `timeout`."""
    client, server = pair
    client.liveness.timeout = 0.4
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="sent nothing for 0.4 s"):
        await client.recv_array(into=np.empty(4, np.float32))
    assert 0.35 < time.monotonic() - t0 < 1.5


async def test_heartbeats_keep_an_idle_peer_alive(pair):
    client, server = pair
    client.liveness.timeout = 0.4
    server.liveness.heartbeat = 0.1
    recv = asyncio.ensure_future(client.recv_msg())
    await asyncio.sleep(1.0)
    assert not recv.done(), "heartbeats should keep the peer alive"
    await server.send_msg("message", {"ok": 1})
    assert (await recv)[1] == {"ok": 1}


async def test_close_and_abort_reach_the_peer(pair):
    client, server = pair
    waiting = asyncio.ensure_future(server.recv_msg())
    await asyncio.sleep(0.01)
    await client.close()
    with pytest.raises(PeerClosed, match="closed the connection"):
        await waiting
    with pytest.raises(PeerClosed):
        await server.recv_msg()


async def test_abort_reason_reaches_the_peer():
    accepted = asyncio.get_running_loop().create_future()
    async with Listener(lambda conn, hello: accepted.set_result(conn)) as listener:
        await listener.start("127.0.0.1", 0)
        client = await connect("127.0.0.1", listener.port, rank=3)
        server = await accepted
        waiting = asyncio.ensure_future(server.recv_array(into=np.empty(2)))
        await asyncio.sleep(0.01)
        client.abort("rank 7 (10.0.0.7:1) died")
        with pytest.raises(PeerAborted, match=r"rank 3 .*gave up: rank 7 \(10\.0\.0\.7:1\) died"):
            await waiting


async def test_refused_names_the_address():
    listener = await Listener(lambda c, h: None).start("127.0.0.1", 0)
    port = listener.port
    await listener.close()
    with pytest.raises(PeerUnreachable, match=rf"rank 5 \(127\.0\.0\.1:{port}\): cannot connect"):
        await connect("127.0.0.1", port, peer_rank=5, connect_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable):
        await connect("127.0.0.1", port, peer_rank=5, connect_timeout=0.5, retry=True)
    assert time.monotonic() - t0 < 2.0


async def test_send_after_close_raises(pair):
    client, _server = pair
    await client.close()
    with pytest.raises(PeerClosed):
        client.write_frame(ARRAY, b"x")
    with pytest.raises(PeerClosed):
        await client.recv_msg()


async def test_frames_queue_until_asked_for_in_order(pair):
    client, server = pair
    for i in range(5):
        client.write_frame(ARRAY, np.full(3, i, np.int16), tag=i)
    await client.flush()
    await asyncio.sleep(0.05)
    for i in range(5):
        assert (await server.recv_array(dtype=np.int16, tag=i)).tolist() == [i] * 3
    client.write_frame(ARRAY, np.zeros(3, np.int16), tag=9)
    with pytest.raises(ProtocolError, match="out of step"):
        await server.recv_array(into=as_bytes_view(np.empty(3, np.int16)), tag=10)


@pytest.mark.parametrize("queued", [False, True], ids=["reading", "reading-paused"])
async def test_last_words_survive_a_peer_still_sending(pair, queued):
    """A rank that gives up keeps reading (and dropping) until the peer has read why, even when it
    closes at once: closing with unread input resets the connection, and the peer, busy writing
    to us, would fail on the reset (broken pipe) and blame us instead of the rank that died.
    With frames queued past the bound (reading paused), giving up resumes reading."""
    client, server = pair
    if queued:
        server._receives.max_queued = 1 << 20
        for _ in range(2):
            client.write_array(np.ones(1 << 19, dtype=np.float32))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server._receives.reading_paused:
                break
        assert server._receives.reading_paused
    client.transport.pause_reading()  # the peer's loop is busy: our last words wait in its socket
    server.abort("rank 2 (10.0.0.2:1) died")
    client.write_array(np.ones(4 << 20, dtype=np.float32))  # more than the sockets hold
    closing = asyncio.ensure_future(server.close())
    await asyncio.sleep(0.3)
    if client.transport is not None:  # (reset: the transport is gone, and the error says broken pipe)
        client.transport.resume_reading()
    with pytest.raises(PeerAborted, match=r"gave up: rank 2 \(10\.0\.0\.2:1\) died"):
        await client.recv_msg(timeout=5)
    await asyncio.wait_for(closing, 1.0)  # the peer closed: no wait for the linger's end (2 s)
