"""Compile (and cache) the numba kernels for the array types they meet in practice, so the first
chat after installing does not wait for the JIT: `python -m dllama.kernels.warmup`.

A kernel is compiled once per argument type: weights are read-only views of a GGUF map on the
root (C-contiguous whole matrices, strided column slices), read-only received slices on
workers, or rows packed in RAM (kernels/packing.py); activations are writable arrays.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ..quant import FORMATS, K_QUANTS, QType, quantize
from . import ops, read_only
from .activations import Activations
from .attention import attention, softmax
from .matmul import matmul
from .packing import PACKABLE, PackedRows
from .simd_q8 import TILE_TOKENS

# a prompt's tokens: enough for the prefill tiles, whose activations some formats read in a layout
# of their own (Activations.q8_paired and q8_starts, kernels of their own), as well as for one token
TOKENS = (1, TILE_TOKENS + 1)


def _weights(rng, qtype: QType, rows: int, cols: int) -> np.ndarray:
    """A read-only matrix of `qtype` (blocks of zeros where dllama has no quantizer for it: the
    kernels' types are all that matters here)."""
    if qtype in K_QUANTS:
        return read_only(np.zeros((rows, FORMATS[qtype].row_bytes(cols)), np.uint8))
    return read_only(quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype))


def warm_up(verbose: bool = False, every_format: bool = False) -> float:
    """Compiles the kernels of the default model's formats (Q4_0, Q4_1, Q8_0 share one kernel), or
    with every_format those of every format and operation (the test suite's: compiled once here,
    not by each of its processes at the same time)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for qtype in QType if every_format else (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.F32):
        cols = 512 if qtype in K_QUANTS else 128  # (K-quants: super-blocks of 256 values)
        data = _weights(rng, qtype, 64, cols)
        column_slice = data[:, : data.shape[1] // 2]  # strided rows, as the root's own shard
        packed = PackedRows.pack(data, qtype) if qtype in PACKABLE else None  # as every node holds these formats
        for w in (data, column_slice):
            w_cols = cols if w is data else cols // 2
            for T in TOKENS:
                x = rng.standard_normal((T, w_cols), dtype=np.float32)
                matmul(w, qtype, Activations(x))
                matmul(w, qtype, Activations(x), wide=True)
                if packed is not None and w is data:
                    # (fresh activations: quantized for packed rows, not reused from the calls above)
                    matmul(packed, qtype, Activations(x))
                    matmul(packed, qtype, Activations(x), wide=True)
                    primed = Activations(x)
                    primed.q8  # Q8 first, as activations gathered as Q8 blocks: the tiles' layout made from it
                    matmul(packed, qtype, primed)
        if qtype in PACKABLE:  # rows long enough to be walked span by span
            long_rows = PackedRows.pack(_weights(rng, qtype, 8, 4096), qtype)
            one_token = Activations(rng.standard_normal((1, 4096), dtype=np.float32))
            matmul(long_rows, qtype, one_token)
            matmul(long_rows, qtype, one_token, wide=True)
        if verbose:
            print(f"  {qtype.name} matmul ready", file=sys.stderr)
    x = rng.standard_normal((3, 128), dtype=np.float32)
    ops.rmsnorm(x, np.ones(128, np.float32), 1e-5)  # (loaded or in a GGUF map: one kernel, read_only)
    ops.silu_mul(x, x)
    ops.top_k(x[0], 3)
    ops.log_sum_exp(x[0], 0.7)
    q = rng.standard_normal((3, 4, 64), dtype=np.float32)
    ops.rope(q, np.arange(3), 64, 10000.0, False)
    ops.rope(q, np.arange(3), 64, 10000.0, False, read_only(np.ones(32, np.float32)))
    k_cache = np.zeros((2, 32, 64), np.float16)
    v_cache = np.zeros((2, 64, 32), np.float16)
    attention(q, k_cache, v_cache, np.array([0, 0, 1, 1]), 0)
    attention(q[:1], k_cache, v_cache, np.array([0, 0, 1, 1]), 3)
    if every_format:  # the other architectures' operations (gemma3: GELU, soft-capping; MoE: the router's softmax)
        ops.gelu_mul(x, x)
        ops.softcap(x[0], 30.0)
        ops.softcap(x, 30.0)
        softmax(x)
    return time.perf_counter() - t0


if __name__ == "__main__":
    every = sys.argv[1:] == ["--every-format"]
    if sys.argv[1:] and not every:
        sys.exit("usage: python -m dllama.kernels.warmup [--every-format]")
    print(f"compiling kernels{' of every format' if every else ''} (cached for later runs) ...", file=sys.stderr)
    print(f"kernels ready in {warm_up(verbose=True, every_format=every):.1f} s", file=sys.stderr)
