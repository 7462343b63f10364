"""Memory: weights run straight off the memory map, or packed into RAM in place of its pages, so
opening the default model and running it costs about the file's size in RSS, not a float copy of
it nor two copies (measured in a fresh subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

SCRIPT = r"""
import asyncio, gc, json, sys

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

from dllama.engine import LocalEngine
from dllama.gguf_model import GGUFModel
from dllama.sampling import SamplingParams

greedy = SamplingParams(temperature=0.0)
# load the compiled kernels on a tiny model first, so that compilation / cache loading is not counted
warm = LocalEngine(GGUFModel(sys.argv[2]), 64)
asyncio.run(warm.feed([1, 2, 3], greedy))
asyncio.run(warm.feed([4], greedy))
del warm
gc.collect()

base = rss()
model = GGUFModel(sys.argv[1])
opened = rss()
engine = LocalEngine(model, 256)
asyncio.run(engine.feed(list(range(100, 132)), greedy))  # one forward pass over a 32-token prompt
asyncio.run(engine.feed([7], greedy))  # and a decode step
after = rss()
print(json.dumps({"base": base, "opened": opened, "after": after}))
"""


def test_rss_growth_is_about_the_file_size(model_path, synthetic_model):
    warm_model = synthetic_model("Q8_0")
    result = subprocess.run([sys.executable, "-c", SCRIPT, model_path, warm_model], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    size = os.path.getsize(model_path)
    opened, total = m["opened"] - m["base"], m["after"] - m["base"]
    print(f"\nRSS: open +{opened / 1e6:.1f} MB, open + forward +{total / 1e6:.1f} MB; file {size / 1e6:.1f} MB "
          f"(ratio {total / size:.3f})")
    assert total <= 1.25 * size
    assert opened <= 0.1 * size  # opening reads the header, not the vocabulary or the weights


def test_block_format_matrices_are_packed_into_ram_with_the_same_rows(gguf_model):
    """The 32-value block formats' matrices are packed (kernels/packing.py), whole or cut: a copy
    in RAM (the map's pages released: the RSS test above counts them once) holding the slice's
    rows exactly; the embedding lookup still reads the map."""
    from dllama.kernels.packing import PackedRows
    from dllama.model import ShardWeights
    from dllama.plan import Plan

    mapped = gguf_model.file.data("blk.0.ffn_down.weight")
    alone = ShardWeights.from_gguf(gguf_model, Plan.single(gguf_model.config).shards[0])
    w_down = alone.layers[0].w_down.data
    assert isinstance(w_down, PackedRows) and not np.shares_memory(w_down.groups, mapped)
    np.testing.assert_array_equal(w_down.unpack(), mapped)
    node0 = ShardWeights.from_gguf(gguf_model, Plan.split(gguf_model.config, [1, 1]).shards[0], "reduce")
    layer = node0.layers[0]
    np.testing.assert_array_equal(layer.w_down.data.unpack(), gguf_model.matrix("blk.0.ffn_down.weight").col_slice(
        0, layer.w_down.cols).data)
    np.testing.assert_array_equal(layer.w_gate.data.unpack(), gguf_model.matrix("blk.0.ffn_gate.weight").row_slice(
        0, layer.w_gate.rows).data)
    assert np.shares_memory(gguf_model.matrix("token_embd.weight").data, gguf_model.file.data("token_embd.weight"))


def test_q_k_v_and_gate_up_are_one_matrix_each_held_once(gguf_model):
    """Each layer's Q, K and V (gate and up) are stacked into one packed matrix, one product per
    layer: the three are views of it (RAM: the rows once, and nbytes counts them once), its
    products are theirs bit for bit, and where formats differ they stay apart."""
    from dllama.kernels.activations import Activations
    from dllama.model import ShardWeights
    from dllama.plan import Plan
    from dllama.quant import QType, quantize
    from dllama.weights import Matrix, stack_rows

    weights = ShardWeights.from_gguf(gguf_model, Plan.single(gguf_model.config).shards[0])
    layer = weights.layers[0]
    for stacked, parts in ((layer.wqkv, (layer.wq, layer.wk, layer.wv)), (layer.w_gate_up, (layer.w_gate, layer.w_up))):
        assert stacked is not None and stacked.rows == sum(p.rows for p in parts)
        assert all(np.shares_memory(p.data.groups, stacked.data.groups) for p in parts)
        x = Activations(np.random.default_rng(0).standard_normal((3, stacked.cols), dtype=np.float32))
        np.testing.assert_array_equal(stacked.matmul(x), np.concatenate([p.matmul(x) for p in parts], axis=1))
    parts_bytes = sum(m.nbytes for layer in weights.layers for m in (layer.wq, layer.wk, layer.wv, layer.w_gate,
                                                                         layer.w_up, layer.w_down, layer.wo))
    assert weights.nbytes < parts_bytes + weights.lm_head.nbytes + 1_000_000  # norms only beside the matrices
    values = np.random.default_rng(1).standard_normal((16, 64), dtype=np.float32)
    q4_0, q8_0 = (Matrix(q, 16, 64, quantize(values, q)).packed() for q in (QType.Q4_0, QType.Q8_0))
    assert stack_rows([q4_0, q8_0]) is None  # formats differ
    assert stack_rows([q4_0, Matrix(QType.Q4_0, 5, 64, quantize(values[:5], QType.Q4_0)).packed()]) is None  # padded


def test_other_formats_stay_in_the_map_and_their_column_slices_are_copied(synthetic_model):
    """Without a packed kernel (F16 here), whole matrices and row slices stay views of the map;
    reduce mode's Wo and W2 column slices are copied into compact rows once (read from the map
    their parts are strided, which defeats prefetching: 2-3x slower)."""
    from dllama.gguf_model import GGUFModel
    from dllama.model import ShardWeights
    from dllama.plan import Plan

    model = GGUFModel(synthetic_model("F16"))
    mapped = model.file.data("blk.0.ffn_down.weight")
    alone = ShardWeights.from_gguf(model, Plan.single(model.config).shards[0])
    assert np.shares_memory(alone.layers[0].w_down.data, mapped)
    layer = ShardWeights.from_gguf(model, Plan.split(model.config, [1, 1]).shards[0], "reduce").layers[0]
    for copied in (layer.w_down, layer.wo):
        assert copied.data.flags.c_contiguous and not np.shares_memory(copied.data, mapped)
    np.testing.assert_array_equal(layer.w_down.data, model.matrix("blk.0.ffn_down.weight").col_slice(
        0, layer.w_down.cols).data)
    assert np.shares_memory(layer.w_gate.data, model.file.data("blk.0.ffn_gate.weight"))  # rows: a view


def test_expert_rows_stay_in_the_map_and_their_column_slices_are_packed(synthetic_model):
    """A node's hidden units of every expert (row slices) are views of the map; reduce mode's
    column slices of the down projections are packed."""
    from dllama.gguf_model import GGUFModel
    from dllama.model import ShardWeights
    from dllama.plan import Plan

    model = GGUFModel(synthetic_model("qwen3moe-tiny"))
    layer = ShardWeights.from_gguf(model, Plan.split(model.config, [1, 1]).shards[1], "reduce").layers[0]
    assert np.shares_memory(layer.w_gate.data, model.file.data("blk.0.ffn_gate_exps.weight"))
    assert not np.shares_memory(layer.w_down.data, model.file.data("blk.0.ffn_down_exps.weight"))
    assert layer.w_down.data.flags.c_contiguous
