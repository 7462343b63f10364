"""Compute kernels: numba (prange, nogil, cache) beside a plain numpy reference of each."""

import os

import numba

# numba's on-disk cache of every kernel (cache=CACHE); set DLLAMA_NO_JIT_CACHE to inspect the generated assembly
CACHE = "DLLAMA_NO_JIT_CACHE" not in os.environ

# OpenMP launches a parallel region in a few microseconds; numba's fallback 'workqueue' layer
# takes ~100 us, which is more than a small layer's whole matvec.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def set_threads(n: int | None) -> int:
    """Use n compute threads (None: all cores numba sees). Returns the number in use."""
    limit = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(max(1, min(limit, n or limit)))
    return numba.get_num_threads()
