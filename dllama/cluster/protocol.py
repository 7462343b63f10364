"""Root <-> worker control protocol, on top of dllama.net framing.

    root                                   worker
    PROBE {measure}                  ->
                                     <-    PROBED {gmacs, mem_available, threads, version}
    ECHO {payload}                   ->    (--sync-mode auto: the root times the link, a few times)
                                     <-    ECHO {payload}          (the same bytes back)
    SETUP {session, rank, world, addrs, algo, sync_dtype, sync_mode, config, shards, ctx_size, manifest,
           slots, kv_budget}  ->
                                     <-    NEED {names}            (what its slice cache lacks)
    TENSOR (raw, chunked) per needed tensor, in manifest order  ->
                                     <-    LOADED {}               (checksums verified)
    GO {}                            ->    (both join the sync group)
                                     <-    READY {rss_mb, load_s, cached}
    FORWARD {seqs: [{slot, start, n, capacity, logits, targets, params, recent}], free, copies: [{src, dst, n,
             capacity}]}
      + ACTIVATIONS (raw, n x dim f32, the seqs' tokens one after another)  ->
                                     <-    RESULT {summaries, stats}   or FAILED {error}
    END {}                           ->    (session over; the worker waits for the next root)

Any message may be answered by FAILED {error}; the session then ends on both sides.
Each message's fields, types and ranges are its schema in messages.py, which both sides use.
"""

from __future__ import annotations

from ..net import MSG, RAW, register_kind

TENSOR_CHUNK = 8 << 20  # weight bytes per TENSOR frame
MAX_SETUP = 32 << 20  # the manifest of a big model is long

PROBE = register_kind("cluster.probe", 64, MSG)
PROBED = register_kind("cluster.probed", 65, MSG)
SETUP = register_kind("cluster.setup", 66, MSG, MAX_SETUP)
NEED = register_kind("cluster.need", 67, MSG, MAX_SETUP)
TENSOR = register_kind("cluster.tensor", 68, RAW, TENSOR_CHUNK)
LOADED = register_kind("cluster.loaded", 69, MSG)
GO = register_kind("cluster.go", 70, MSG)
READY = register_kind("cluster.ready", 71, MSG)
FORWARD = register_kind("cluster.forward", 72, MSG, 16 << 20)
ACTIVATIONS = register_kind("cluster.activations", 73, RAW, 256 << 20)
RESULT = register_kind("cluster.result", 74, MSG, 64 << 20)
FAILED = register_kind("cluster.failed", 75, MSG)
END = register_kind("cluster.end", 76, MSG)
ECHO_BYTES = 256 << 10  # the largest ECHO payload: enough to time the bytes past the latency
MAX_ECHOES = 64  # ECHOs a worker answers before SETUP
ECHO = register_kind("cluster.echo", 77, MSG, ECHO_BYTES + 256)


def chunks(nbytes: int):
    """(start, stop) byte ranges in which a tensor travels."""
    for start in range(0, nbytes, TENSOR_CHUNK):
        yield start, min(nbytes, start + TENSOR_CHUNK)
