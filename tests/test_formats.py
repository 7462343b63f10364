"""K-quants beyond one node: a model quantized by llama.cpp to Q4_K_M (Q4_K and Q6_K) is cut on
256-value super-blocks, runs on a cluster in both sync modes (gather: the 1-node bits), does not
depend on how its tokens are chunked, and a split that would cut a super-block is one clear
error. (Against llama.cpp: test_fidelity.py::test_requantized_by_llama_cpp_runs_native.)"""

from __future__ import annotations

import numpy as np
import pytest

from dllama.errors import DllamaError
from dllama.gguf_model import GGUFModel
from dllama.model import shard_tensors
from dllama.plan import Plan
from dllama.quant import K_QUANTS
from dllama.sampling import SamplingParams
from dllama.sync_config import SyncConfig

from .engine_helpers import our_logits, text


@pytest.fixture(scope="module")
def k_model(requantized_model):
    model = GGUFModel(requantized_model("Q4_K_M", source="F16-256"))
    types = {model.matrix(f"blk.0.{part}.weight").qtype for part in ("attn_q", "attn_output", "ffn_down")}
    assert types & set(K_QUANTS), types
    return model


async def test_k_quant_logits_do_not_depend_on_chunking(k_model):
    tokens = np.random.default_rng(8).integers(0, k_model.config.vocab_size, 80).tolist()
    by_chunk = [await our_logits(k_model, tokens, chunk=chunk) for chunk in (1, 7, 64, 80)]
    for other in by_chunk[1:]:
        np.testing.assert_array_equal(other, by_chunk[0])


def test_the_plan_cuts_the_ffn_on_super_blocks(k_model):
    assert k_model.config.ffn_block == 256  # its FFN down projections are K-quants
    for weights in ([1, 1], [2, 1, 1], [1, 3]):
        for shard in Plan.split(k_model.config, weights).shards:
            assert shard.ffn[0] % 256 == 0 and shard.ffn[1] % 256 == 0
    with pytest.raises(DllamaError, match="more than the 4 FFN blocks of 256"):
        Plan.split(k_model.config, [1] * 5)


def test_heads_that_cut_a_super_block_are_one_clear_error(k_model):
    """Reduce mode cuts the attention output's columns at head boundaries: 3 nodes share 8 heads
    of 64 as 3/3/2, columns 192.. — not whole 256-value super-blocks of a K-quant."""
    shard = Plan.split(k_model.config, [1, 1, 1]).shards[1]
    with pytest.raises(DllamaError, match="use --sync-mode gather"):
        dict(shard_tensors(k_model, shard, "reduce"))
    dict(shard_tensors(k_model, shard, "gather"))  # rows: any split


@pytest.mark.parametrize("sync_mode, sync_dtype, n_workers", [("gather", "f32", 2), ("reduce", "f64", 1)])
async def test_k_quant_cluster(k_model, tokenizer, sync_mode, sync_dtype, n_workers):
    """Every position's target logit and best token are the 1-node bits: in gather mode, and in
    reduce mode with float64 partial sums (2 nodes: 4 heads = 256 columns of Wo each)."""
    from dllama.engine import LocalEngine

    from .cluster_helpers import in_process_cluster

    tokens = tokenizer.encode(text())[:49]
    greedy = SamplingParams(temperature=0.0)
    alone = await LocalEngine(k_model, 64, SyncConfig(dtype=sync_dtype)).feed(tokens[:-1], greedy, targets=tokens[1:])
    async with in_process_cluster(k_model, n_workers, sync_mode=sync_mode, sync_dtype=sync_dtype, ctx=64) as (
            engine, _):
        positions = await engine.feed(tokens[:-1], greedy, targets=tokens[1:])

    def target_and_best(per_node):
        target = next(s.target_logit for s in per_node if s.target_logit is not None)
        best = max(per_node, key=lambda s: (s.logits[0], -s.ids[0]))
        return np.float32(target), int(best.ids[0])

    for i, (ours, reference) in enumerate(zip(positions, alone)):
        assert target_and_best(ours) == target_and_best(reference), i
