"""The array being reduced, and how its values go on and come off the wire.

Algorithms move element ranges [lo, hi) of a flat array; a Reducer turns such a range into
bytes to send and buffers to receive into, so one algorithm serves every codec:

partial values (on their way to being summed):
    send_partial(lo, hi)        bytes to send (exact: a view of `a` itself, zero-copy)
    partial_buffer(lo, hi, s)   where a partial from a peer lands (scratch slot s)
    accumulate(lo, hi, s)       a[lo:hi] = a[lo:hi] (op) slot s
    stage_own(lo, hi, s)        copy our own partial into slot s (exact) or encode it there and
                                keep only its decoded value: the owner uses what the others see
    combine(lo, hi, slots)      a[lo:hi] = slots[0] (op) slots[1] (op) ...  in that order
final values (reduced, being distributed):
    send_final(lo, hi)          the owner's bytes; with a codec the owner encodes once and
                                keeps the decoded value, so every rank ends bit-identical
    final_buffer(lo, hi)        where final values land (exact: straight into `a`)
    final_received(lo, hi)      decode them into `a` (no-op when exact)
    forward_final(lo, hi)       relay received final bytes unchanged
"""

from __future__ import annotations

import numpy as np

from .codecs import Codec
from .ops import Op


class Scratch:
    """Reusable byte buffers, grown on demand, one per key."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, key, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(key)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._bufs[key] = buf
        return buf[:nbytes]

    def clear(self):
        self._bufs.clear()


class Reducer:
    __slots__ = ("a", "a8", "op", "combine_fn", "codec", "isz", "n", "scratch", "_slot_cache", "exact", "plans")

    def __init__(self, a: np.ndarray, op: Op, codec: Codec, scratch: Scratch):
        self.a = a  # flat, C-contiguous, the caller's memory
        self.a8 = a.view(np.uint8)
        self.op = op
        self.combine_fn = op.combine
        self.codec = codec
        self.exact = codec.exact
        self.isz = a.dtype.itemsize
        self.n = a.size
        self.scratch = scratch
        self._slot_cache = {}
        self.plans = {}  # per algorithm: whatever it precomputes for this size (views, peers)

    def bind(self, a: np.ndarray) -> "Reducer":
        """Reuse this reducer (and its scratch views) for another array of the same size/dtype."""
        self.a = a
        self.a8 = a.view(np.uint8)
        return self

    # -- geometry
    def wire_range(self, lo: int, hi: int) -> tuple[int, int]:
        if self.exact:
            return lo * self.isz, hi * self.isz
        c = self.codec
        return c.wire_offset(lo, self.isz), c.wire_offset(lo, self.isz) + c.wire_nbytes(hi - lo, self.isz)

    def wire_total(self) -> int:
        return self.codec.wire_nbytes(self.n, self.isz)

    def _slot(self, key) -> np.ndarray:
        buf = self._slot_cache.get(key)
        if buf is None:
            buf = self.scratch.get(key, self.wire_total() if not self.exact else self.n * self.isz)
            self._slot_cache[key] = buf
        return buf

    def _values(self, buf: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return buf[lo * self.isz: hi * self.isz].view(self.a.dtype)

    # -- partial values
    def send_partial(self, lo, hi, key="out"):
        if self.exact:
            return self.a8[lo * self.isz: hi * self.isz]
        w0, w1 = self.wire_range(lo, hi)
        wire = self._slot(key)[w0:w1]
        self.codec.encode(self.a[lo:hi], wire)
        return wire

    def partial_buffer(self, lo, hi, slot=0):
        w0, w1 = self.wire_range(lo, hi)
        return self._slot(("in", slot))[w0:w1]

    def accumulate(self, lo, hi, slot=0):
        buf = self._slot(("in", slot))
        if self.exact:
            self.combine_fn(self.a[lo:hi], self._values(buf, lo, hi))
        else:
            w0, w1 = self.wire_range(lo, hi)
            self.codec.decode_add(buf[w0:w1], self.a[lo:hi])

    def stage_own(self, lo, hi, slot):
        """Our own partial into slot `slot`; returns the bytes to send to the others."""
        buf = self._slot(("in", slot))
        w0, w1 = self.wire_range(lo, hi)
        if self.exact:
            buf[w0:w1] = self.a8[w0:w1]
        else:
            self.codec.encode(self.a[lo:hi], buf[w0:w1])
        return buf[w0:w1]

    def combine(self, lo, hi, slots):
        out = self.a[lo:hi]
        if self.exact:
            vals = [self._values(self._slot(("in", s)), lo, hi) for s in slots]
            ufunc = self.op.ufunc
            if ufunc is not None and len(vals) > 1:
                ufunc(vals[0], vals[1], out=out)
            else:
                np.copyto(out, vals[0])
                if len(vals) > 1:
                    self.combine_fn(out, vals[1])
            for v in vals[2:]:
                self.combine_fn(out, v)
        else:
            w0, w1 = self.wire_range(lo, hi)
            self.codec.decode(self._slot(("in", slots[0]))[w0:w1], out)
            for s in slots[1:]:
                self.codec.decode_add(self._slot(("in", s))[w0:w1], out)

    def slot_values(self, slot, lo, hi) -> np.ndarray:
        """The values of a partial received into slot `slot` (exact codec)."""
        return self._values(self._slot(("in", slot)), lo, hi)

    def combine_own(self, lo, hi, me: int, p: int, others=None) -> bool:
        """a[lo:hi] = x0 (op) x1 (op) ... x(p-1) in rank order, where x_me is a[lo:hi] itself and
        the others are in their slots (or given: others[s], None at s = me); no copy of our
        own partial. Exact ufunc ops only (returns False otherwise, and the caller stages its
        own partial instead)."""
        ufunc = self.op.ufunc
        if not self.exact or ufunc is None:
            return False
        out = self.a[lo:hi]
        if others is None:
            terms = [out if s == me else self.slot_values(s, lo, hi) for s in range(p)]
        else:
            terms = list(others)
            terms[me] = out
        if me <= 1:  # a is one of the first two terms: combine straight into it
            ufunc(terms[0], terms[1], out=out)
        else:  # accumulate the ranks before us in our (unused) slot, then fold us in
            acc = self.slot_values(me, lo, hi)
            ufunc(terms[0], terms[1], out=acc)
            for t in terms[2:me]:
                ufunc(acc, t, out=acc)
            ufunc(acc, out, out=out)
        for t in terms[max(me, 1) + 1:]:
            ufunc(out, t, out=out)
        return True

    def requantize(self, lo, hi, key="out"):
        """Encode our current values, keep the decoded ones (both partners of an exchange must
        sum the same two encoded vectors); returns the bytes to send."""
        if self.exact:
            return self.a8[lo * self.isz: hi * self.isz]
        w0, w1 = self.wire_range(lo, hi)
        wire = self._slot(key)[w0:w1]
        self.codec.encode(self.a[lo:hi], wire)
        self.codec.decode(wire, self.a[lo:hi])
        return wire

    # -- final values
    def send_final(self, lo, hi):
        """The final values to send, encoded once; ours become what the receivers decode."""
        return self.requantize(lo, hi, "final")

    def final_buffer(self, lo, hi):
        if self.exact:
            return self.a8[lo * self.isz: hi * self.isz]
        w0, w1 = self.wire_range(lo, hi)
        return self._slot("final")[w0:w1]

    def final_received(self, lo, hi):
        if not self.exact:
            w0, w1 = self.wire_range(lo, hi)
            self.codec.decode(self._slot("final")[w0:w1], self.a[lo:hi])

    forward_final = final_buffer

    def raw(self, lo, hi):
        """The values themselves as bytes (for fold-in/fold-out steps that must stay exact)."""
        return self.a8[lo * self.isz: hi * self.isz]
