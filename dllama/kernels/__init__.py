"""Compute kernels: numba (prange, nogil, cache) beside a plain numpy reference of each."""

import hashlib
import os
from pathlib import Path

import numba
import numpy as np

# numba's on-disk cache of every kernel (cache=CACHE); set DLLAMA_NO_JIT_CACHE to inspect the generated assembly
CACHE = "DLLAMA_NO_JIT_CACHE" not in os.environ
# DLLAMA_SERIAL_KERNELS: numba's parallel loops compiled as plain loops (parallel=PARALLEL): the same loop
# bodies and intrinsics, the same bits, on one thread. For the emulated aarch64 runs, which use one thread
# anyway, and in which numba compiling each parallel loop as a function of its own took half of every
# kernel's compile under qemu.
PARALLEL = "DLLAMA_SERIAL_KERNELS" not in os.environ


def _jit_cache_dir() -> Path:
    """numba revalidates a cached kernel against its own source file only, not against the modules
    that generate its IR (simd*.py) or the tables it reads (quant.py): a change there would run the
    old machine code. So the cache lives in a directory named by a hash of all of them."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for source in sorted(here.glob("*.py")) + [here.parent / "quant.py"]:
        digest.update(source.read_bytes())
    for flag in ("DLLAMA_AVX2_ONLY", "DLLAMA_NO_DOTPROD", "DLLAMA_SERIAL_KERNELS"):  # they change the IR
        digest.update(flag.encode() if flag in os.environ else b"")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dllama" / f"jit-{digest.hexdigest()[:16]}"


if CACHE and not os.environ.get("NUMBA_CACHE_DIR"):
    try:
        _dir = _jit_cache_dir()
        _dir.mkdir(parents=True, exist_ok=True)
        if os.access(_dir, os.W_OK):  # else numba's own choice (next to the sources, or none)
            numba.config.CACHE_DIR = str(_dir)
    except OSError:
        pass

def read_only(a: np.ndarray) -> np.ndarray:
    """`a`, or a read-only view of it. numba compiles a kernel once per argument type, and whether an
    array is writable is part of its type: the kernels take weights read-only (as a GGUF map gives
    them), so that one compiled kernel serves weights loaded or converted in RAM as well (a cold
    test suite compiled _mm_quant eight times, four of them for writable weights only tests make)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


# Up to this many values, a kernel of independent rows (RMSNorm, RoPE, SiLU, Q8 quantization) runs on
# the calling thread: a thread team's start and its barrier cost more than the work, and more again
# when another thread (a server's event loop) holds a core, since the team waits for its slowest.
# In `dllama serve` at 8 users (SmolLM2, 2 threads, py-spy of the compute thread): RMSNorm 7% and Q8
# quantization 8% of the compute with their rows split between two threads.
SERIAL_VALUES = 8192

# OpenMP launches a parallel region in a few microseconds; numba's fallback 'workqueue' layer
# takes ~100 us, which is more than a small layer's whole matvec.
numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def set_threads(n: int | None) -> int:
    """Use n compute threads (None: all cores numba sees). Returns the number in use."""
    limit = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(max(1, min(limit, n or limit)))
    return numba.get_num_threads()
