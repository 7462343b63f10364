"""--sync-mode auto: the pricing of both modes on a measured link (which one a latency-bound and a
bandwidth-bound link get, which dtypes each may use), and the root settling it for a real session
over real worker daemons (the link timed by ECHO round trips). The same choice across network
namespaces with a shaped link is in test_netns_cluster.py."""

from __future__ import annotations

import re

import pytest

from dllama.cluster.link import WorkerLink
from dllama.cluster.sync_mode import reduce_fits
from dllama.errors import DllamaError
from dllama.gguf_model import GGUFModel
from dllama.plan import Plan
from dllama.sync.auto import predicted_seconds
from dllama.sync_config import LinkFigures, SyncConfig

from .cluster_helpers import greedy_tokens, in_process_cluster

LAN = LinkFigures(alpha=50e-6, beta=1e-9, gamma=1e-10)  # a message costs far more than its bytes
SLOW = LinkFigures(alpha=50e-6, beta=1e-7, gamma=1e-10)  # 10 MB/s: the bytes dominate


def test_dtype_defaults_follow_the_mode():
    assert SyncConfig(mode="reduce").dtype == "f32" and SyncConfig(mode="gather").dtype == "q80"
    assert SyncConfig(mode="auto").dtype is None and SyncConfig(mode="auto").alone() == SyncConfig(mode="reduce")
    with pytest.raises(DllamaError, match="gather carries f32 or q80"):
        SyncConfig(mode="gather", dtype="f16")
    with pytest.raises(DllamaError, match="unknown sync mode"):
        SyncConfig(mode="fastest")
    with pytest.raises(RuntimeError, match="settled by the root"):
        SyncConfig(mode="auto").codec


def test_bytes_per_layer_of_each_mode(gguf_model):
    cfg = gguf_model.config
    assert SyncConfig(mode="reduce").layer_collectives(cfg, True, True) == [("all_reduce", cfg.dim * 4.0)] * 2
    q8 = SyncConfig(mode="gather").layer_collectives(cfg, True, True)
    assert [c for c, _ in q8] == ["all_gather"] * 4
    q8_values = cfg.n_heads * cfg.head_dim + cfg.ffn_dim  # attention output and FFN hidden, 36 bytes per 32
    assert sum(n for _, n in q8) == pytest.approx(q8_values * 36 / 32 + 2 * cfg.dim * 4)
    # K-quant weights read Q8_K blocks: gather's q80 cannot send theirs, the values travel as f32
    kq = SyncConfig(mode="gather").layer_collectives(cfg, False, False)
    assert sum(n for _, n in kq) == (cfg.n_heads * cfg.head_dim + cfg.ffn_dim + 2 * cfg.dim) * 4


@pytest.mark.parametrize("algo, link, q8, expected", [
    ("auto", LAN, True, "reduce (f32)"), ("star", LAN, True, "reduce (f32)"),
    ("ring", LAN, True, "gather (q80)"),  # a ring all-reduce takes as many steps as four all-gathers, more bytes
    ("auto", SLOW, True, "gather (q80)"), ("ring", SLOW, True, "gather (q80)"),
    ("star", SLOW, True, "reduce (f32)"),  # a star's root relays every gathered byte to every node
    ("auto", SLOW, False, "reduce (f32)"),  # K-quants: gather's values would travel as f32
])
def test_auto_prices_both_modes_on_the_link(gguf_model, link, q8, expected, algo):
    """Fewer collectives win where latency dominates, fewer bytes where the link is slow (gather
    sends fewer only where its Q8 blocks travel, and not through a star's root)."""
    chosen, predicted = SyncConfig(algo, "auto").choose(gguf_model.config, 3, link, q8, q8)
    assert chosen.label == expected and set(predicted) == {"reduce (f32)", "gather (q80)"}
    assert predicted[expected] == min(predicted.values())


def test_an_algorithm_is_priced_as_what_it_runs():
    """Rabenseifner's all-gather is recursive doubling's (it has none of its own), not the cheapest one."""
    link = (SLOW.alpha, SLOW.beta, SLOW.gamma)
    assert predicted_seconds("all_gather", "rabenseifner", 1e5, 3, *link) == predicted_seconds("all_gather", "rd",
                                                                                                1e5, 3, *link)
    assert predicted_seconds("all_gather", "rd", 1e5, 3, *link) > predicted_seconds("all_gather", "auto", 1e5, 3,
                                                                                    *link)


def test_reduce_q80_is_priced_at_its_codec_bytes(gguf_model):
    cfg = gguf_model.config
    assert SyncConfig(mode="reduce", dtype="q80").layer_collectives(cfg, True, True) == [
        ("all_reduce", cfg.dim * 36 / 32)] * 2  # an f32 scale and 32 int8 per block (sync/codecs.py)


def test_auto_keeps_an_asked_dtype(gguf_model):
    cfg = gguf_model.config
    only_reduce, predicted = SyncConfig(mode="auto", dtype="f16").choose(cfg, 2, SLOW, True, True)
    assert only_reduce == SyncConfig(mode="reduce", dtype="f16") and list(predicted) == ["reduce (f16)"]
    _, predicted = SyncConfig(mode="auto", dtype="q80").choose(cfg, 2, SLOW, True, True)
    assert list(predicted) == ["reduce (q80)", "gather (q80)"]
    assert SyncConfig(mode="auto").choose(cfg, 1, SLOW, True, True)[1] == {"reduce (f32)": 0.0, "gather (q80)": 0.0}


@pytest.fixture(scope="module")
def model(synthetic_model):
    return GGUFModel(synthetic_model("Q4_1"))


async def test_the_root_settles_auto_on_the_measured_loopback(model):
    """On loopback a message costs far more than the tiny model's bytes: reduce, from figures
    measured by ECHO round trips to each worker, and the session runs in it."""
    async with in_process_cluster(model, 2, algo="auto", sync_mode="auto", sync_dtype=None, ctx=64) as (engine, _):
        choice = engine.sync_choice
        assert engine.sync == SyncConfig("auto", "reduce", "f32") and choice["chosen"] == "reduce (f32)"
        assert 0 < choice["alpha_s"] < 0.05 and 0 < choice["beta_s_per_byte"] < 1e-6
        assert choice["predicted_sync_ms_per_token"]["reduce (f32)"] < choice["predicted_sync_ms_per_token"][
            "gather (q80)"]
        assert len(await greedy_tokens(engine, [1, 17, 300, 4242, 99], 4)) == 4
        assert all(w.last_stats["sent"] > 0 for w in engine.workers)


def test_the_cli_says_what_auto_chose(synthetic_model):
    from .cluster_helpers import run_dllama

    r = run_dllama("inference", "--model", synthetic_model("Q4_1"), "-p", "hi", "-n", "2", "--threads", "1",
                   "--sync", "auto", "--local-workers", "1")
    assert r.returncode == 0, r.stderr
    assert "2 node(s) (auto sync, reduce, f32)" in r.stderr
    assert re.search(r"--sync-mode auto: reduce \(f32\) on the measured link \(\d+ us per message, \d+ MB/s\); "
                     r"predicted sync ms/token: reduce \(f32\) [\d.]+, gather \(q80\) [\d.]+", r.stderr), r.stderr


async def test_a_recovery_keeps_the_mode_auto_chose(model, monkeypatch):
    """A worker lost mid-session: the rest of the answer runs in the mode it began in (not priced
    again for fewer nodes, which could switch modes in the middle of an answer)."""
    timed, time_link = [], WorkerLink.time_link

    async def counted(self, *args, **kwargs):
        timed.append(self.address)
        return await time_link(self, *args, **kwargs)

    monkeypatch.setattr(WorkerLink, "time_link", counted)
    async with in_process_cluster(model, 2, algo="auto", sync_mode="auto", sync_dtype=None, ctx=64,
                                  timeout=5) as (engine, workers):
        chosen, choice = engine.sync, engine.sync_choice
        assert len(timed) == 2 and engine.n_nodes == 3
        await workers[1].close()
        assert len(await greedy_tokens(engine, [1, 17, 300, 4242, 99], 4)) == 4
        assert engine.n_nodes == 2 and any("recovered" in e for e in engine.events)
        assert engine.sync == chosen and engine.sync_choice == choice and len(timed) == 2


async def test_auto_leaves_out_reduce_where_a_k_quant_cannot_be_cut(requantized_model):
    """Q4_K's attention output is cut in columns of 256: 3 nodes get 3, 3 and 2 heads of 64, which
    reduce mode cannot cut, so auto takes gather (which cuts rows) without timing the link."""
    kq = GGUFModel(requantized_model("Q4_K_M", pure=True, source="F16-256"))
    assert reduce_fits(kq, Plan.split(kq.config, [1, 1]).shards)
    assert not reduce_fits(kq, Plan.split(kq.config, [1, 1, 1]).shards)
    async with in_process_cluster(kq, 2, algo="auto", sync_mode="auto", sync_dtype=None, ctx=64) as (engine, _):
        assert engine.sync.mode == "gather" and "only mode" in engine.sync_choice["reason"]
        assert len(await greedy_tokens(engine, [1, 17, 300, 4242, 99], 4)) == 4
