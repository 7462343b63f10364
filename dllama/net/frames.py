"""Wire format: a fixed 16-byte little-endian header, then the body.

    magic  4s  b"DLMA"
    version u8 PROTOCOL_VERSION
    kind   u8  frame kind (registry below)
    flags  u16 reserved, 0
    tag    u32 free for the user of the kind; collectives put their call number here
    length u32 body bytes

A body is either msgpack (control messages: a map, decoded with bounded sizes, no ext types) or
raw bytes (arrays, weight slices). Nothing is ever unpickled. Every length is checked against a
limit before any buffer is allocated for it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

PROTOCOL_VERSION = 9  # 3: every step summed in the one-token order (batch-invariant kernels); 4: ECHO;
# 5: steps of several sequences, each with its KV cache slot (continuous batching); 6: a step's
# copies made layer by layer after its keys and values (a source may compute them in that step);
# 7: a greedy position's summary carries no log-sum-exp (None) unless a target asks for it;
# 8: a temperature below sampling.MIN_TEMPERATURE is greedy, sampling fields within sampling's ranges;
# 9: the CHALLENGE names the session the listening node serves (a peer dials only its own cluster's)
MAGIC = b"DLMA"
HEADER = struct.Struct("<4sBBHII")
HEADER_SIZE = HEADER.size  # 16

MSG = "msg"  # msgpack map body
RAW = "raw"  # raw bytes body

DEFAULT_MAX_MSG = 1 << 20  # control messages: 1 MiB
MAX_FRAME_LIMIT = (1 << 32) - 1  # what the u32 length field can carry


@dataclass(frozen=True)
class FrameKind:
    code: int
    name: str
    body: str  # MSG or RAW
    max_len: int | None  # None: the connection's max_frame


class KindRegistry:
    """Frame kinds by name and code. Codes 0-63 belong to dllama.net / dllama.sync; an application
    (the cluster) registers its own kinds with codes 64-255."""

    RESERVED = 64

    def __init__(self):
        self._by_code: dict[int, FrameKind] = {}
        self._by_name: dict[str, FrameKind] = {}

    def register(self, name: str, code: int, body: str = MSG, max_len: int | None = None,
                 _reserved: bool = False) -> FrameKind:
        if body not in (MSG, RAW):
            raise ValueError(f"frame kind {name!r}: body must be {MSG!r} or {RAW!r}")
        if not 0 <= code <= 255:
            raise ValueError(f"frame kind {name!r}: code {code} is not in 0..255")
        if code < self.RESERVED and not _reserved:
            raise ValueError(f"frame kind {name!r}: codes below {self.RESERVED} are reserved")
        kind = FrameKind(code, name, body, DEFAULT_MAX_MSG if (max_len is None and body == MSG) else max_len)
        old = self._by_code.get(code) or self._by_name.get(name)
        if old is not None:
            if old == kind:
                return old  # registering the same kind twice (module reloads) is harmless
            raise ValueError(f"frame kind {name!r} (code {code}) clashes with {old.name!r} (code {old.code})")
        self._by_code[code] = kind
        self._by_name[name] = kind
        return kind

    def get(self, key: str | int | FrameKind) -> FrameKind:
        if isinstance(key, FrameKind):
            return key
        table = self._by_name if isinstance(key, str) else self._by_code
        try:
            return table[key]
        except KeyError:
            raise KeyError(f"unknown frame kind {key!r}") from None

    def by_code(self, code: int) -> FrameKind | None:
        return self._by_code.get(code)

    def __iter__(self):
        return iter(sorted(self._by_code.values(), key=lambda k: k.code))


KINDS = KindRegistry()


def register_kind(name: str, code: int, body: str = MSG, max_len: int | None = None) -> FrameKind:
    """Register an application frame kind (code 64-255) on the process-wide registry."""
    return KINDS.register(name, code, body, max_len)


def _builtin(name, code, body=MSG, max_len=None):
    return KINDS.register(name, code, body, max_len, _reserved=True)


# Handshake
HELLO = _builtin("hello", 1)
CHALLENGE = _builtin("challenge", 2)
AUTH = _builtin("auth", 3)
WELCOME = _builtin("welcome", 4)
REJECT = _builtin("reject", 5)
# Liveness and shutdown, handled inside the connection, never delivered to a receiver
PING = _builtin("ping", 8, RAW, 0)
BYE = _builtin("bye", 9, RAW, 0)
ABORT = _builtin("abort", 10, MSG, 64 << 10)
# Payloads
ARRAY = _builtin("array", 16, RAW)
MESSAGE = _builtin("message", 17, MSG)

INTERNAL_CODES = frozenset((PING.code, BYE.code, ABORT.code))


def pack_header(kind: FrameKind, tag: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind.code, 0, tag & 0xFFFFFFFF, length)


def frame_limit(kind: FrameKind, max_frame: int) -> int:
    """The most body bytes a frame of `kind` may carry on a connection with `max_frame`."""
    return max_frame if kind.max_len is None else min(kind.max_len, max_frame)


def check_header(magic, code: int, length: int, kinds: KindRegistry, max_frame: int):
    """(kind, None) for a header we may read the body of, else (None, what is wrong). The
    version is checked by the connection, which answers a mismatch in its own version."""
    if magic != MAGIC:
        # (what it sent is not repeated: a node told to dial an address would report what answers there)
        return None, "it does not speak the dllama protocol"
    kind = kinds.by_code(code)
    if kind is None:
        return None, f"unknown frame kind {code}"
    limit = frame_limit(kind, max_frame)
    if length > limit:
        return None, f"{kind.name} frame of {length} bytes exceeds the limit of {limit} bytes"
    return kind, None


def pack_msg(body: dict) -> bytes:
    if not isinstance(body, dict):
        raise TypeError(f"a control message must be a dict, not {type(body).__name__}")
    return msgpack.packb(body, use_bin_type=True)


def _no_ext(code, data):
    raise ValueError(f"msgpack ext type {code} is not allowed")


def unpack_msg(data) -> dict:
    """Decode a msgpack map. The frame length already bounds every size inside it."""
    n = len(data)
    obj = msgpack.unpackb(
        data, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True,
        max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
    )
    if not isinstance(obj, dict):
        raise ValueError(f"control message is a {type(obj).__name__}, not a map")
    return obj
