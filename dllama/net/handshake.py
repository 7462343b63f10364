"""Connection handshake: protocol version, role, rank, session, optional mutual HMAC challenge.

    client -> HELLO     {proto, role, rank, world, session, addr, nonce}
    server -> CHALLENGE {proto, rank, session, nonce, auth}   (or REJECT {reason})
    client -> AUTH      {mac}    mac = HMAC(secret, "client" | server nonce | client nonce | hello)
    server -> WELCOME   {mac}    mac = HMAC(secret, "server" | client nonce | server nonce | session)
                                 (or REJECT {reason})

Both sides prove they know the secret without sending it, and a recorded exchange cannot be
replayed (fresh nonces on both sides). Without a secret on both sides the macs are empty; a
secret on one side only is an authentication failure, reported on both sides.

A peer (a rank dialing another of its sync group) checks that the node it reached serves its own
session: an address it was given that answers anything else (another cluster's node, or no dllama
node at all) is a failure that names the address, never what it sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from ..errors import AuthError, NetworkError, ProtocolError, VersionMismatch
from . import frames as F
from .connection import Connection
from .peer import PeerRef

ROLES = ("peer", "control")
NONCE_BYTES = 16
HANDSHAKE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Hello:
    """What a connecting node said about itself."""

    role: str  # "peer" (sync mesh) or "control" (root -> worker)
    rank: int | None
    world: int | None
    session: str
    addr: tuple[str, int] | None  # where the connecting node itself listens, if anywhere
    proto: int = F.PROTOCOL_VERSION


def _secret_bytes(secret) -> bytes | None:
    if secret is None or secret == "":
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _hello_bytes(h: dict) -> bytes:
    return F.pack_msg({k: h.get(k) for k in ("proto", "role", "rank", "world", "session", "addr")})


def _check_proto(msg: dict, conn: Connection):
    proto = msg.get("proto")
    if proto != F.PROTOCOL_VERSION:
        version = proto if type(proto) is int else "(none)"  # (never more of what the other side sent)
        raise VersionMismatch(f"speaks dllama protocol version {version}, this node speaks {F.PROTOCOL_VERSION}",
                              conn.peer)


def _field(msg: dict, name: str, types, conn: Connection, optional=False):
    v = msg.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, types) or (isinstance(v, bool) and types is int):
        raise ProtocolError(f"handshake field {name!r} is missing or has the wrong type", conn.peer)
    return v


async def client_handshake(conn: Connection, *, role: str = "peer", rank: int | None = None,
                           world: int | None = None, session: str = "", secret=None,
                           addr: tuple[str, int] | None = None, timeout: float = HANDSHAKE_TIMEOUT,
                           same_session: bool = False) -> dict:
    """Run the client side on a fresh connection. Returns the server's CHALLENGE fields.
    same_session: the server must serve `session` (a peer of the same group)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    key = _secret_bytes(secret)
    cnonce = os.urandom(NONCE_BYTES)
    hello = {"proto": F.PROTOCOL_VERSION, "role": role, "rank": rank, "world": world, "session": session,
             "addr": list(addr) if addr else None, "nonce": cnonce}
    conn.write_frame(F.HELLO, F.pack_msg(hello))
    kind, msg = await conn.recv_msg((F.CHALLENGE, F.REJECT), timeout=timeout)
    if kind == "reject":
        raise _rejection(msg, conn)
    _check_proto(msg, conn)
    snonce = _field(msg, "nonce", bytes, conn)
    ssession = _field(msg, "session", str, conn, optional=True)
    if same_session and ssession != session:
        conn.write_frame(F.AUTH, F.pack_msg({"mac": b""}))
        raise ProtocolError("is not a node of this cluster (it serves another session, or none)", conn.peer)
    srank = _field(msg, "rank", int, conn, optional=True)
    if srank is not None and conn.peer.rank is None:
        conn.peer = PeerRef(srank, conn.peer.host, conn.peer.port)
    if bool(msg.get("auth")) != (key is not None):
        why = ("requires a shared secret and none was given" if msg.get("auth")
               else "does not use a shared secret but one was given")
        conn.write_frame(F.AUTH, F.pack_msg({"mac": b""}))
        raise AuthError(f"authentication failed: the peer {why}", conn.peer)
    mac = _mac(key, b"client", snonce, cnonce, _hello_bytes(hello)) if key else b""
    conn.write_frame(F.AUTH, F.pack_msg({"mac": mac}))
    kind, msg = await conn.recv_msg((F.WELCOME, F.REJECT), timeout=timeout)
    if kind == "reject":
        raise _rejection(msg, conn)
    if key is not None:
        smac = _field(msg, "mac", bytes, conn)
        if not hmac.compare_digest(smac, _mac(key, b"server", cnonce, snonce, (ssession or "").encode())):
            raise AuthError("authentication failed: the peer does not know the shared secret", conn.peer)
    return msg


async def server_handshake(conn: Connection, *, secret=None, rank: int | None = None,
                           serving: str | None = None, timeout: float = HANDSHAKE_TIMEOUT) -> Hello:
    """Run the server side on an accepted connection; returns the client's Hello. `serving`: the
    session this node serves (None: none yet). On failure the client is told why (REJECT) before the
    error is raised here."""
    key = _secret_bytes(secret)
    try:
        _kind, msg = await conn.recv_msg(F.HELLO, timeout=timeout)
        _check_proto(msg, conn)
        role = _field(msg, "role", str, conn)
        if role not in ROLES:
            raise ProtocolError(f"unknown connection role {role!r}", conn.peer)
        crank = _field(msg, "rank", int, conn, optional=True)
        world = _field(msg, "world", int, conn, optional=True)
        session = _field(msg, "session", str, conn)
        addr = _field(msg, "addr", list, conn, optional=True)
        cnonce = _field(msg, "nonce", bytes, conn)
        if addr is not None:
            if len(addr) != 2 or not isinstance(addr[0], str) or not isinstance(addr[1], int):
                raise ProtocolError("handshake field 'addr' must be [host, port]", conn.peer)
            addr = (addr[0], addr[1])
        hello = Hello(role, crank, world, session, addr)
        conn.peer = PeerRef(crank, *(addr if addr else (conn.peer.host, conn.peer.port)))
        snonce = os.urandom(NONCE_BYTES)
        conn.write_frame(F.CHALLENGE, F.pack_msg(
            {"proto": F.PROTOCOL_VERSION, "rank": rank, "session": serving, "nonce": snonce,
             "auth": key is not None}))
        _kind, auth = await conn.recv_msg(F.AUTH, timeout=timeout)
        if key is not None:
            mac = auth.get("mac")
            if not isinstance(mac, bytes) or not hmac.compare_digest(
                    mac, _mac(key, b"client", snonce, cnonce, _hello_bytes(msg))):
                raise AuthError("authentication failed: wrong or missing shared secret", conn.peer)
            conn.write_frame(F.WELCOME, F.pack_msg({"mac": _mac(key, b"server", cnonce, snonce,
                                                                 (serving or "").encode())}))
        else:
            if auth.get("mac"):
                raise AuthError("authentication failed: the peer uses a shared secret, this node does not",
                                conn.peer)
            conn.write_frame(F.WELCOME, F.pack_msg({}))
        conn.hello = hello
        return hello
    except NetworkError as e:
        if not conn.closed:
            try:
                reason = getattr(e, "reason", str(e))
                conn.write_frame(F.REJECT, F.pack_msg({"reason": reason, "type": type(e).__name__}))
            except Exception:
                pass
        raise


def _rejection(msg: dict, conn: Connection) -> NetworkError:
    reason = str(msg.get("reason", "no reason given"))[:500]
    cls = {"AuthError": AuthError, "VersionMismatch": VersionMismatch}.get(msg.get("type"), ProtocolError)
    return cls(f"refused the connection: {reason}", conn.peer)
