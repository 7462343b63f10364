"""The frame parser without a socket: any stream of frames, cut into reads anywhere, gives the
same frames, whether payloads are staged, read straight into their buffers, or taken whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dllama.net import frames as F
from dllama.net.parser import DIRECT_MIN, FrameParser


class RecordingSink:
    def __init__(self, take_whole: bool):
        self.frames, self.take_whole, self.taken = [], take_whole, 0
        self.parser = None

    def take_staged(self, magic, version, code, tag, length, start) -> bool:
        if not self.take_whole:
            return False
        self.frames.append((code, tag, bytes(self.parser.stage_mv[start:start + length])))
        self.taken += 1
        return True

    def begin_frame(self, magic, version, code, tag, length):
        assert (magic, version) == (F.MAGIC, F.PROTOCOL_VERSION)
        return F.KINDS.by_code(code), memoryview(bytearray(length))

    def finish_frame(self, kind, tag, dest):
        self.frames.append((kind.code, tag, bytes(dest)))


def feed(parser: FrameParser, stream: bytes, cuts: list[int]) -> None:
    """Deliver `stream` as the event loop would: into get_buffer(), at most `cut` bytes a read."""
    pos, i = 0, 0
    while pos < len(stream):
        buf = parser.get_buffer()
        n = min(len(buf), len(stream) - pos, max(1, cuts[i % len(cuts)]))
        buf[:n] = stream[pos:pos + n]
        parser.fed(n)
        pos, i = pos + n, i + 1


frames_st = st.lists(st.tuples(st.sampled_from([F.ARRAY.code, F.MESSAGE.code]), st.integers(0, 2**32 - 1),
                               st.one_of(st.binary(max_size=64), st.integers(DIRECT_MIN, 3 * DIRECT_MIN))),
                     min_size=1, max_size=12)


@given(frames=frames_st, cuts=st.lists(st.integers(1, 70_000), min_size=1, max_size=8), take_whole=st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_cut_of_the_stream_gives_the_same_frames(frames, cuts, take_whole):
    frames = [(code, tag, body if isinstance(body, bytes) else bytes(range(256)) * (body // 256) + b"x")
              for code, tag, body in frames]
    stream = b"".join(F.HEADER.pack(F.MAGIC, F.PROTOCOL_VERSION, code, 0, tag, len(body)) + body
                      for code, tag, body in frames)
    sink = RecordingSink(take_whole)
    sink.parser = parser = FrameParser(sink)
    feed(parser, stream, cuts)
    assert sink.frames == frames
    assert parser.kind is None and parser.lo == parser.hi  # nothing half-parsed is left
    if take_whole and len(stream) <= min(cuts) and all(len(body) < DIRECT_MIN for _c, _t, body in frames):
        assert sink.taken == len(frames)  # small frames staged whole in one read: the fast path took each


def test_a_big_payload_is_read_straight_into_its_buffer():
    body = bytes(range(256)) * (4 * DIRECT_MIN // 256)
    sink = RecordingSink(take_whole=False)
    parser = FrameParser(sink)
    header = F.HEADER.pack(F.MAGIC, F.PROTOCOL_VERSION, F.ARRAY.code, 0, 7, len(body))
    feed(parser, header + body[:100], [len(header) + 100])
    buf = parser.get_buffer()
    assert parser.direct is not None and len(buf) == len(body) - 100  # the rest lands in place
    buf[:] = body[100:]
    parser.fed(len(body) - 100)
    assert sink.frames == [(F.ARRAY.code, 7, body)]
    assert len(parser.get_buffer()) == F.HEADER_SIZE  # after a big frame: the next header alone
