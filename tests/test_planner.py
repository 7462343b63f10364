"""The planner (dllama/planner.py) on given figures, and `dllama plan` measuring real worker processes."""

from __future__ import annotations

import json
import math

import pytest

from dllama.errors import DllamaError
from dllama.gguf_model import GGUFModel
from dllama.model import shard_peak_bytes
from dllama.planner import NodeFigures, candidates, choose, fill
from dllama.sync_config import LinkFigures, SyncConfig

from .cluster_helpers import WorkerProcess, run_dllama

LAN = LinkFigures(alpha=100e-6, beta=1 / 100e6, gamma=1e-10)  # 0.1 ms a message, 100 MB/s
GB = 1_000_000_000


@pytest.fixture(scope="module")
def model(model_path):
    return GGUFModel(model_path)


def _plan(model, nodes, link=LAN, sync="auto", ctx=256):
    def slice_bytes(plan, mode):
        return [shard_peak_bytes(model, s, mode) for s in plan.shards]

    found = candidates(model.config, nodes, link, SyncConfig(mode=sync), slice_bytes, ctx)
    return found, choose(found)


def test_shares_follow_the_speeds_and_a_node_that_slows_the_cluster_is_left_out(model):
    nodes = [NodeFigures("root", 2.0, 8 * GB), NodeFigures("w1", 1.0, 8 * GB), NodeFigures("w2", 0.02, 8 * GB)]
    found, chosen = _plan(model, nodes)
    assert {c.members for c in found} == {(0,), (0, 1), (0, 1, 2)}  # the fastest workers first
    two = next(c for c in found if c.members == (0, 1))
    assert two.weights == pytest.approx((2 / 3, 1 / 3))
    assert chosen.members == (0, 1), [(c.members, c.total_s) for c in found]  # w2 is 100x slower than the root
    # alike nodes on a fast link: all of them
    alike = [NodeFigures(f"n{i}", 1.0, 8 * GB) for i in range(3)]
    assert _plan(model, alike)[1].members == (0, 1, 2)
    # ... on a link where a message costs 50 ms: alone
    assert _plan(model, alike, LinkFigures(alpha=0.05, beta=1e-8, gamma=1e-10))[1].members == (0,)


def test_a_node_s_memory_caps_its_share_and_a_plan_that_fits_nowhere_is_one_error(model):
    whole = model.file_size
    nodes = [NodeFigures("root", 1.0, 8 * GB), NodeFigures("small", 4.0, whole // 3)]  # 4x faster, holds < 1/3
    found, chosen = _plan(model, nodes)
    both = next(c for c in found if c.members == (0, 1))
    assert both.short is None and 0.2 < both.weights[1] < 1 / 3, both  # not the 4/5 its speed would give it
    tiny = [NodeFigures("root", 1.0, whole // 4), NodeFigures("w1", 1.0, whole // 4)]
    with pytest.raises(DllamaError, match="no plan fits the nodes' memory"):
        _plan(model, tiny)
    assert fill([1.0, 1.0], [0.3, 0.3]) is None and fill([1.0, 3.0], [1.0, 0.5]) == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("gmacs, memory", [(0.0, GB), (-3.0, GB), (math.nan, GB), (math.inf, GB), (1e300, GB),
                                           ("fast", GB), (1.0, -1), (1.0, "lots"), (None, None)])
def test_absurd_figures_are_unknown_and_do_not_crash_the_planner(model, gmacs, memory):
    liar = NodeFigures.of("liar", gmacs, memory)
    assert liar.gmacs in (None, 1.0) and liar.mem_available in (None, GB)
    found, chosen = _plan(model, [NodeFigures("root", 1.0, 8 * GB), liar])
    assert all(math.isfinite(c.total_s) for c in found if c.short is None) and chosen.members[0] == 0


def test_plan_measures_worker_processes_and_chooses(model_path):
    """Two workers, one of which admits 1 MB: the plan measures both (their speed, memory and the
    link), predicts every candidate, gives the small one no more than its memory holds, and chooses one."""
    ws = [WorkerProcess(), WorkerProcess("--max-memory", "1")]
    try:
        r = run_dllama("plan", "--workers", ",".join(w.address for w in ws), "--ctx-size", "256", "--json")
        text = run_dllama("plan", "--workers", ws[0].address, "--ctx-size", "256")
    finally:
        for w in ws:
            w.stop()
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert [n["gmacs"] > 0 for n in report["nodes"]] == [True] * 3
    assert report["nodes"][2]["mem_available"] == 1_000_000 and report["link"]["alpha_s"] > 0
    assert len([c for c in report["candidates"] if c["chosen"]]) == 1
    with_small = [c for c in report["candidates"] if any(ws[1].address in name for name in c["nodes"])]
    assert with_small and all(c["short"] or c["weights"][c["nodes"].index(report["nodes"][2]["name"])] < 0.01
                              for c in with_small), with_small  # ~1 MB of a ~100 MB model, or it does not fit
    assert text.returncode == 0 and "chosen (*):" in text.stdout and "GMAC/s" in text.stdout, text.stderr
