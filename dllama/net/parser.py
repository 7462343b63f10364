"""The receive half of one framed stream, socket-free: where the next bytes should go
(`get_buffer`) and what they make (`fed`). Small frames arrive whole in a staging buffer; the
remainder of a big payload is read straight into its destination (zero-copy); after a big frame
the next header is read alone, so no payload bytes are staged and copied.

The parser knows the header layout and nothing of what frames mean. Its sink (the Connection)
checks each header and says where the payload goes (`begin_frame`), takes whole frames
(`finish_frame`), and may take a whole staged frame at once (`take_staged`: its payload is
stage_mv[start:start + length])."""

from __future__ import annotations

from . import frames as F

STAGE_SIZE = 256 << 10  # staging buffer: small frames arrive whole in one recv()
DIRECT_MIN = 16 << 10  # a payload remainder at least this big is read straight into its buffer

_HS = F.HEADER_SIZE
_unpack_header = F.HEADER.unpack_from


class FrameParser:
    def __init__(self, sink):
        self.sink = sink
        self.stage = bytearray(STAGE_SIZE)
        self.stage_mv = memoryview(self.stage)
        self.lo = 0  # unparsed bytes are stage[lo:hi]
        self.hi = 0
        self.kind: F.FrameKind | None = None  # frame in progress (None: reading a header)
        self.tag = 0
        self.dest: memoryview | None = None  # where its payload goes
        self.filled = 0
        self.direct: memoryview | None = None  # set: the loop reads straight into the payload
        self.header_only = False  # after a big frame, read the next header alone (no staging copy)
        self.stopped = False  # the sink failed: bytes are dropped from now on

    def get_buffer(self) -> memoryview:
        if self.direct is not None:
            return self.direct
        lo, hi = self.lo, self.hi
        if lo:
            if lo < hi:  # a partial header: move it to the front
                self.stage[: hi - lo] = self.stage[lo:hi]
            self.lo, self.hi = 0, hi - lo
            hi = hi - lo
        if self.header_only and self.kind is None:
            return self.stage_mv[hi:_HS]
        return self.stage_mv[hi:]

    def fed(self, nbytes: int) -> None:
        """`nbytes` arrived where get_buffer() said."""
        if self.stopped:
            self.lo = self.hi = 0
            return
        direct = self.direct
        if direct is not None:
            self.filled += nbytes
            if nbytes == len(direct):
                self.direct = None
                self._finish()
            else:
                self.direct = direct[nbytes:]
            return
        self.hi += nbytes
        self._parse()

    def stop(self) -> None:
        self.stopped = True
        self.direct = None
        self.header_only = False  # what still comes is dropped in whole staging buffers

    def redirect(self, into: memoryview) -> None:
        """The frame in progress goes to `into` instead (what has arrived so far is moved)."""
        filled = self.filled
        into[:filled] = self.dest[:filled]
        self.dest = into
        if self.direct is not None:
            self.direct = into[filled:]

    def _parse(self):
        stage, sink = self.stage_mv, self.sink
        while not self.stopped:
            if self.kind is None:
                lo, hi = self.lo, self.hi
                if hi - lo < _HS:
                    return
                magic, version, code, _flags, tag, length = _unpack_header(self.stage, lo)
                if hi - lo - _HS >= length and sink.take_staged(magic, version, code, tag, length, lo + _HS):
                    self.lo = lo + _HS + length
                    continue
                self.lo += _HS
                begun = sink.begin_frame(magic, version, code, tag, length)
                if begun is None:
                    return
                self.kind, self.dest = begun
                self.tag, self.filled, self.header_only = tag, 0, length >= DIRECT_MIN
                if length == 0:
                    self._finish()
                    continue
            need = len(self.dest) - self.filled
            avail = self.hi - self.lo
            if avail >= need:
                self.dest[self.filled:] = stage[self.lo:self.lo + need]
                self.lo += need
                self.filled += need
                self._finish()
                continue
            if avail:
                self.dest[self.filled:self.filled + avail] = stage[self.lo:self.hi]
                self.filled += avail
            self.lo = self.hi = 0
            if need - avail >= DIRECT_MIN:
                self.direct = self.dest[self.filled:]
            return

    def _finish(self):
        kind, tag, dest = self.kind, self.tag, self.dest
        self.kind = self.dest = None
        self.sink.finish_frame(kind, tag, dest)
