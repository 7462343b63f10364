"""Typed receive and send over a Connection's frames: control messages (msgpack maps of a MSG
kind) and raw arrays (zero-copy into a given array, or a new one of a dtype), each receive with
an optional timeout and the checks that turn a malformed payload into a connection failure."""

from __future__ import annotations

import numpy as np

from ..errors import MalformedFrame
from . import frames as F
from .matching import as_bytes_view


class MessageIO:
    """Mixed into Connection, which provides kinds, peer, post_recv, write_frame, flush, _fail
    and _receives."""

    # ------------------------------------------------------------------ receive
    async def recv_msg(self, kinds=F.MESSAGE, timeout: float | None = None) -> tuple[str, dict]:
        """Receive the next control message; `kinds`: a kind (name, code or FrameKind) or a list.
        Returns (kind name, body dict)."""
        want = tuple(self.kinds.get(k) for k in (kinds if isinstance(kinds, (list, tuple, set)) else (kinds,)))
        for k in want:
            if k.body != F.MSG:
                raise ValueError(f"frame kind {k.name!r} carries raw bytes; use recv_bytes/recv_array")
        fut = self.post_recv(None, want, None, max(k.max_len or self.max_frame for k in want))
        kind, _tag, buf = await self._receives.wait(fut, timeout)
        try:
            return kind.name, F.unpack_msg(buf)
        except Exception as e:
            err = MalformedFrame(f"unreadable {kind.name} message: {e}", self.peer)
            self._fail(err)
            raise err from None

    async def recv_bytes(self, kind=F.ARRAY, max_len: int | None = None, timeout: float | None = None,
                         tag: int | None = None) -> bytearray:
        """Receive the next raw frame into a new bytearray (length bounded by `max_len`)."""
        k = self.kinds.get(kind)
        fut = self.post_recv(None, k, tag, max_len)
        _kind, _tag, buf = await self._receives.wait(fut, timeout)
        return buf

    async def recv_array(self, into=None, *, dtype=None, kind=F.ARRAY, max_len: int | None = None,
                         timeout: float | None = None, tag: int | None = None) -> np.ndarray:
        """Receive the next raw frame as an array. With `into` (a C-contiguous writable array) the
        payload lands in it and its size must match; otherwise a 1-D array of `dtype` is allocated
        (at most `max_len` bytes)."""
        k = self.kinds.get(kind)
        if into is not None:
            await self._receives.wait(self.post_recv(as_bytes_view(into), k, tag), timeout)
            return into
        dt = np.dtype(dtype if dtype is not None else np.uint8)
        buf = await self._receives.wait(self.post_recv(None, k, tag, max_len), timeout)
        buf = buf[2]
        if len(buf) % dt.itemsize:
            err = MalformedFrame(f"{len(buf)}-byte frame is not a whole number of {dt} items", self.peer)
            self._fail(err)
            raise err
        return np.frombuffer(buf, dtype=dt)

    # ------------------------------------------------------------------ send
    async def send_msg(self, kind, body: dict) -> None:
        """Send a control message (a msgpack map) of a MSG kind."""
        k = self.kinds.get(kind)
        if k.body != F.MSG:
            raise ValueError(f"frame kind {k.name!r} carries raw bytes; use send_bytes/send_array")
        self.write_frame(k, F.pack_msg(body))
        await self.flush()

    async def send_array(self, array, kind=F.ARRAY, tag: int = 0) -> None:
        """Send a contiguous array (or any bytes-like) as one raw frame; returns when the buffer
        may be reused. Large weight payloads get TCP back-pressure this way."""
        k = self.kinds.get(kind)
        if k.body != F.RAW:
            raise ValueError(f"frame kind {k.name!r} carries a msgpack map; use send_msg")
        if isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                raise ValueError("send_array needs a C-contiguous array")
            array = array.reshape(-1).view(np.uint8)
        self.write_frame(k, array, tag)
        await self.flush()

    send_bytes = send_array
