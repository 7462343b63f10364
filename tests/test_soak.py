"""A soak in the suite: benchmarks/soak.py at a smaller count (96 requests of the mix from 8
clients, after a warm-up of 32) against the real `dllama serve` and two `dllama worker` daemons:
no unexpected answer and no traceback in any log, and once idle every process's RSS within 50 MB
of its value after the warm-up, its file descriptors back to their count, no KV cache held by a
request, and the greedy answer unchanged. The full count (2,000) is `python benchmarks/soak.py`.
(Its first run found a step that copied into one KV slot twice, which the workers refused.)"""

from __future__ import annotations

from benchmarks.soak import Cluster, soak

RSS_MARGIN_MB = 50


def test_everything_comes_back_after_a_mixed_load(model_path):
    cluster = Cluster(model_path)
    try:
        result = soak(cluster, 96, 8, seed=1, warm_up=32)
    finally:
        cluster.stop()
    table = result.table(RSS_MARGIN_MB)
    print("\n" + table)
    assert not result.problems(RSS_MARGIN_MB), table
    assert all(result.outcomes.counts[kind, expected] == 12 for kind, expected in
               (("chat", 200), ("cancel", "hung up"), ("invalid", 400), ("vanish", "vanished")))
