"""Batch invariance: a token's logits are the same bits however its tokens were grouped into
forward passes (alone, in prefill chunks of any size, after a cached prefix) and, in gather mode,
on any number of nodes. Every kernel sums a (row, token) value in the one-token order; these
tests would fail if any path summed a batch in another order (as the attention did before, in
llama.cpp's batched order for 2+ tokens).

The synthetic-model tests need no llama.cpp, so they also run on aarch64 under emulation
(tests/test_aarch64.py), where the kernels take their NEON path."""

from __future__ import annotations

import numpy as np
import pytest

from dllama.gguf_model import GGUFModel
from dllama.sampling import SamplingParams

from .engine_helpers import our_logits, text

pytestmark = pytest.mark.usefixtures("one_compute_thread")

CHUNKS = (1, 7, 64, 512)
N_TEXT_TOKENS = 520


def _assert_all_equal(by_chunk: dict[int, np.ndarray]) -> None:
    (first, ref), *rest = by_chunk.items()
    for chunk, logits in rest:
        differ = np.flatnonzero((logits != ref).any(axis=-1))
        assert differ.size == 0, f"chunks of {chunk} vs {first}: positions {differ[:10].tolist()} differ"


@pytest.fixture(scope="module")
def text_tokens(tokenizer) -> list[int]:
    tokens = tokenizer.encode(text())[:N_TEXT_TOKENS]
    assert len(tokens) == N_TEXT_TOKENS
    return tokens


@pytest.fixture(scope="module")
def logits_by_chunk(gguf_model, text_tokens) -> dict[int, np.ndarray]:
    from dllama.net import run

    return {chunk: run(our_logits(gguf_model, text_tokens, chunk=chunk)) for chunk in CHUNKS}


def test_default_model_logits_do_not_depend_on_chunking(logits_by_chunk):
    assert logits_by_chunk[1].shape == (N_TEXT_TOKENS, 49152)
    _assert_all_equal(logits_by_chunk)


@pytest.mark.parametrize("n_workers,chunk", [(1, 7), (2, 64), (3, 512), (4, 1)])
async def test_gather_mode_cluster_gives_the_one_node_logits(gguf_model, text_tokens, logits_by_chunk,
                                                            n_workers, chunk):
    """Root + n workers over loopback, fed `chunk` tokens per call (the engine cuts at 256): the
    logit of every position's next token, and its best token, are the 1-node bits."""
    from .cluster_helpers import in_process_cluster

    tokens = text_tokens if chunk > 1 else text_tokens[:96]  # 1 token per step: a shorter run
    reference = logits_by_chunk[1]
    greedy = SamplingParams(temperature=0.0)
    async with in_process_cluster(gguf_model, n_workers, sync_mode="gather", sync_dtype="f32",
                                  ctx=N_TEXT_TOKENS + 32) as (engine, _):
        positions = []
        for start in range(0, len(tokens) - 1, chunk):
            stop = min(start + chunk, len(tokens) - 1)
            positions += await engine.feed(tokens[start:stop], greedy, targets=tokens[start + 1:stop + 1])
    assert len(positions) == len(tokens) - 1
    for i, per_node in enumerate(positions):
        assert len(per_node) == n_workers + 1
        target = next(s.target_logit for s in per_node if s.target_logit is not None)
        assert np.float32(target) == reference[i, tokens[i + 1]], f"position {i}: target logit differs"
        best = max(per_node, key=lambda s: (s.logits[0], -s.ids[0]))
        assert (int(best.ids[0]), best.logits[0]) == (int(reference[i].argmax()), reference[i].max()), i


async def test_reduce_mode_cluster_logits_do_not_depend_on_chunking(gguf_model, text_tokens, monkeypatch):
    """Reduce mode (f32 partial sums, --sync auto) is not the 1-node bits, but one request still
    gets one answer: the all-reduces sum each value in rank order whatever the step's size (auto
    picks among mesh and star for them), so a position's logits are the same in a step of 1 token
    and of 64. Ring, which auto would take for 64 tokens' sums, starts each block's sum at a rank
    that depends on where the block falls in the message."""
    from dllama.sync.auto import IN_RANK_ORDER, Auto

    from .cluster_helpers import in_process_cluster

    async def a_lan(self):  # every rank the same figures (a 100 us, 100 MB/s link), not loopback's noisy ones
        self.alpha, self.beta, self.gamma = 100e-6, 1 / 100e6, 1 / 2e9
        self.decisions.clear()

    monkeypatch.setattr(Auto, "calibrate", a_lan)
    tokens = text_tokens[:65]
    greedy = SamplingParams(temperature=0.0)
    targets = {}
    async with in_process_cluster(gguf_model, 2, algo="auto", sync_mode="reduce", sync_dtype="f32",
                                  ctx=N_TEXT_TOKENS + 32) as (engine, _):
        # (the test's point: without the rank order, auto would take another algorithm for 64 tokens)
        assert engine.group.choose("all_reduce", 64 * gguf_model.config.dim * 4, "sum") not in IN_RANK_ORDER
        for chunk in (64, 1):
            engine.rewind(0)
            positions = []
            for start in range(0, len(tokens) - 1, chunk):
                stop = min(start + chunk, len(tokens) - 1)
                positions += await engine.feed(tokens[start:stop], greedy, targets=tokens[start + 1:stop + 1])
            targets[chunk] = [next(s.target_logit for s in per_node if s.target_logit is not None)
                              for per_node in positions]
    assert targets[64] == targets[1]


# ------------------------------------------------------------------ synthetic models, no llama.cpp


# (every format's kernels: test_kernels.py::test_matmul_rows_do_not_depend_on_the_batch; K-quant
# models: test_formats.py)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "F16", "Q4_0", "qwen3moe-tiny", "gemma3-softcap"])
async def test_synthetic_logits_do_not_depend_on_chunking(synthetic_model, name):
    model = GGUFModel(synthetic_model(name))
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, 80).tolist()
    _assert_all_equal({chunk: await our_logits(model, tokens, chunk=chunk) for chunk in (1, 7, 64, 80)})


@pytest.mark.parametrize("name", ["Q4_1", "qwen3moe-tiny", "gemma3-softcap"])
async def test_last_layer_for_the_rows_asked_gives_their_bits(synthetic_model, name):
    """forward(out_rows=...) runs the last layer's output projection and feed-forward for those rows
    alone (a prompt's last token: the rows whose logits are asked): it returns them, the bits of the
    same rows of the whole pass, and leaves the same keys and values for the tokens after."""
    from dllama.kv_cache import round_capacity
    from dllama.model import Span
    from dllama.projection import ALONE

    from .engine_helpers import shard_model

    model = GGUFModel(synthetic_model(name))
    embedding = model.matrix("token_embd.weight")
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, 12)
    whole, asked = shard_model(model, 32), shard_model(model, 32)
    for m in (whole, asked):
        m.kv.resize(0, round_capacity(32))
    full = await whole.forward(embedding.row_values(tokens), [Span(0, 0, 12)], ALONE)
    rows = np.array([11, 4])
    some = await asked.forward(embedding.row_values(tokens), [Span(0, 0, 12)], ALONE, out_rows=rows)
    assert some.shape == (2, model.config.dim)
    np.testing.assert_array_equal(some, full[rows])
    after = [await m.forward(embedding.row_values(tokens[:1]), [Span(0, 12, 1)], ALONE) for m in (whole, asked)]
    np.testing.assert_array_equal(after[0], after[1])
