"""Framed, authenticated TCP connections between dllama nodes (asyncio + uvloop).

    conn = await connect(host, port, role="control", secret=S, peer_rank=1)
    await conn.send_msg("message", {"op": "load"});  kind, body = await conn.recv_msg()
    await conn.send_array(weights);                  arr = await conn.recv_array(dtype=np.uint8)

    listener = await Listener(on_connection, secret=S).start("0.0.0.0", 9998)

See frames.py for the wire format and handshake.py for the handshake.
"""

from .connection import DEFAULT_MAX_FRAME, Connection
from .matching import as_bytes_view
from .peer import PeerRef
from .endpoints import ConnectionInbox, Listener, connect
from .frames import (
    ARRAY,
    HEADER,
    HEADER_SIZE,
    KINDS,
    MAGIC,
    MESSAGE,
    MSG,
    PROTOCOL_VERSION,
    RAW,
    FrameKind,
    register_kind,
)
from .handshake import Hello
from .loop import new_event_loop, run

__all__ = [
    "ARRAY", "Connection", "ConnectionInbox", "DEFAULT_MAX_FRAME", "FrameKind", "HEADER", "HEADER_SIZE",
    "Hello", "KINDS", "Listener", "MAGIC", "MESSAGE", "MSG", "PROTOCOL_VERSION", "PeerRef", "RAW",
    "as_bytes_view", "connect", "new_event_loop", "register_kind", "run",
]
