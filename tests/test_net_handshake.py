"""Handshake: roles, ranks, sessions, protocol version, shared-secret HMAC, and a listener that
keeps serving after bad clients. Real sockets throughout; the misbehaving peers are raw sockets."""

from __future__ import annotations

import asyncio
import socket
import tracemalloc

import msgpack
import numpy as np
import pytest

from dllama.errors import AuthError, MalformedFrame, PeerAborted, VersionMismatch
from dllama.net import HEADER, MAGIC, PROTOCOL_VERSION, Listener, connect
from dllama.net import frames as F



class Recorder:
    """A listener callback that records every accepted connection with its Hello."""

    def __init__(self):
        self.accepted = asyncio.Queue()

    def __call__(self, conn, hello):
        self.accepted.put_nowait((conn, hello))


@pytest.fixture
async def served():
    rec = Recorder()
    listener = await Listener(rec, secret="s3cret", rank=0).start("127.0.0.1", 0)
    yield listener, rec
    await listener.close()


async def good_client(listener):
    conn = await connect("127.0.0.1", listener.port, role="control", rank=None, session="job-1",
                         secret="s3cret", peer_rank=0)
    await conn.send_msg("message", {"hi": 1})
    return conn


async def test_hello_reaches_the_owner(served):
    listener, rec = served
    conn = await connect("127.0.0.1", listener.port, role="peer", rank=2, world=4, session="job-1",
                         secret="s3cret", addr=("10.1.2.3", 9998))
    server_conn, hello = await rec.accepted.get()
    assert (hello.role, hello.rank, hello.world, hello.session, hello.addr) == ("peer", 2, 4, "job-1", ("10.1.2.3", 9998))
    assert str(server_conn.peer) == "rank 2 (10.1.2.3:9998)"
    assert conn.peer.rank == 0  # the server told us its rank
    await conn.close()


async def test_wrong_secret_fails_on_both_sides_and_listener_keeps_serving(served):
    listener, rec = served
    with pytest.raises(AuthError, match="authentication failed"):
        await connect("127.0.0.1", listener.port, secret="wrong", peer_rank=0)
    with pytest.raises(AuthError, match="requires a shared secret"):
        await connect("127.0.0.1", listener.port, peer_rank=0)
    assert rec.accepted.empty()
    conn = await good_client(listener)
    server_conn, _ = await rec.accepted.get()
    assert await server_conn.recv_msg() == ("message", {"hi": 1})
    assert listener.rejected == 2
    await conn.close()


async def test_client_with_secret_refuses_open_server():
    rec = Recorder()
    async with Listener(rec) as listener:
        await listener.start("127.0.0.1", 0)
        with pytest.raises(AuthError, match="does not use a shared secret"):
            await connect("127.0.0.1", listener.port, secret="x")
        conn = await connect("127.0.0.1", listener.port)  # both without a secret: fine
        await conn.close()


async def test_server_that_fakes_the_secret_is_caught():
    """Mutual authentication: a server that does not know the secret cannot fake WELCOME."""
    async def impostor(reader, writer):
        hdr = await reader.readexactly(16)
        await reader.readexactly(HEADER.unpack(hdr)[5])
        body = F.pack_msg({"proto": PROTOCOL_VERSION, "rank": 0, "nonce": b"n" * 16, "auth": True})
        writer.write(F.pack_header(F.CHALLENGE, 0, len(body)) + body)
        hdr = await reader.readexactly(16)
        await reader.readexactly(HEADER.unpack(hdr)[5])
        body = F.pack_msg({"mac": b"\x00" * 32})
        writer.write(F.pack_header(F.WELCOME, 0, len(body)) + body)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(AuthError, match="does not know the shared secret"):
        await connect("127.0.0.1", port, secret="s3cret", peer_rank=0)
    server.close()


async def test_version_mismatch_both_ways(served):
    listener, rec = served
    # a newer client: the server answers in its own version, then closes
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    body = msgpack.packb({"proto": PROTOCOL_VERSION + 1})
    writer.write(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, F.HELLO.code, 0, 0, len(body)) + body)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)  # everything until the server hangs up
    magic, version, code, _, _, length = HEADER.unpack_from(reply)
    assert (magic, version, F.KINDS.by_code(code)) == (MAGIC, PROTOCOL_VERSION, F.REJECT)
    assert F.unpack_msg(reply[16:16 + length])["type"] == "VersionMismatch"
    writer.close()

    # a newer server: our client names it and its version
    async def newer(reader, writer):
        await reader.readexactly(16)
        body = msgpack.packb({"proto": PROTOCOL_VERSION + 1})
        writer.write(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, F.CHALLENGE.code, 0, 0, len(body)) + body)
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(newer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    newer_version = rf"rank 3 \(127\.0\.0\.1:{port}\): speaks wire protocol version {PROTOCOL_VERSION + 1}"
    with pytest.raises(VersionMismatch, match=newer_version):
        await connect("127.0.0.1", port, peer_rank=3)
    server.close()
    conn = await good_client(listener)
    await conn.close()
    assert listener.rejected >= 1


async def test_same_version_header_other_proto_in_hello_is_refused(served):
    listener, _ = served
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
    body = F.pack_msg({"proto": 99, "role": "peer", "session": "", "nonce": b"x" * 16})
    writer.write(F.pack_header(F.HELLO, 0, len(body)) + body)
    await writer.drain()
    hdr = await reader.readexactly(16)
    kind = F.KINDS.by_code(HEADER.unpack(hdr)[2])
    reply = F.unpack_msg(await reader.readexactly(HEADER.unpack(hdr)[5]))
    assert kind is F.REJECT and reply["type"] == "VersionMismatch" and "version 99" in reply["reason"]
    writer.close()


def _raw_send(port, data: bytes) -> bytes:
    """Send raw bytes, return whatever comes back before the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        except (ConnectionResetError, socket.timeout):
            pass
        return b"".join(chunks)


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not a dllama peer
    HEADER.pack(MAGIC, PROTOCOL_VERSION, 250, 0, 0, 0),  # unknown kind
    HEADER.pack(MAGIC, PROTOCOL_VERSION, F.HELLO.code, 0, 0, 0xFFFFFFFF),  # 4 GiB hello
    HEADER.pack(MAGIC, PROTOCOL_VERSION, F.ARRAY.code, 0, 0, 0xFFFFFFF0),  # 4 GiB array before auth
    HEADER.pack(MAGIC, PROTOCOL_VERSION, F.HELLO.code, 0, 0, 5) + b"\xc1\xc1\xc1\xc1\xc1",  # bad msgpack
    HEADER.pack(MAGIC, PROTOCOL_VERSION, F.HELLO.code, 0, 0, 3) + msgpack.packb([1, 2]),  # not a map
])
async def test_malformed_frames_are_dropped_without_allocating(served, garbage):
    listener, rec = served
    loop = asyncio.get_running_loop()
    tracemalloc.start()
    try:
        await loop.run_in_executor(None, _raw_send, listener.port, garbage)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"a bad frame made the listener allocate {peak} bytes"
    assert rec.accepted.empty()
    conn = await good_client(listener)  # still serving
    server_conn, _ = await rec.accepted.get()
    assert (await server_conn.recv_msg())[1] == {"hi": 1}
    await conn.close()


async def test_oversized_frame_after_handshake_names_the_peer(served):
    listener, rec = served
    conn = await connect("127.0.0.1", listener.port, rank=6, secret="s3cret", max_frame=1 << 20)
    server_conn, _ = await rec.accepted.get()
    server_conn.max_frame = 1 << 16
    conn.transport.write(HEADER.pack(MAGIC, PROTOCOL_VERSION, F.ARRAY.code, 0, 0, 1 << 30))
    with pytest.raises(MalformedFrame, match=r"rank 6 \(127\.0\.0\.1:\d+\): array frame of 1073741824 bytes "
                                              r"exceeds the limit of 65536"):
        await server_conn.recv_array(dtype=np.uint8)
    with pytest.raises(PeerAborted, match="gave up: .*exceeds the limit of 65536"):  # told why
        await conn.recv_msg(timeout=5)
