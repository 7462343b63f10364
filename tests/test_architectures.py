"""Every supported architecture: each of its tensors is needed (a missing one is named), a tensor
it does not consume or a math-relevant key it does not implement is refused with one line, and a
3-node cluster in gather mode computes exactly what one node does. (Against llama.cpp: the
synthetic-architecture tests in test_fidelity.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGUFWriter

from dllama.architectures import _FEATURES, ARCHITECTURES
from dllama.errors import ModelError
from dllama.gguf_model import GGUFModel
from dllama.sampling import SamplingParams

from .engine_helpers import our_logits

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, EXPERTS = 64, 4, 2, 32, 128, 64, 4
# keys a family needs to load at all (the others' defaults are llama.cpp's)
NEEDED_KEYS = {"qwen3moe": {"expert_count": EXPERTS, "expert_used_count": 2, "expert_feed_forward_length": FFN}}


def _shapes(arch, features: dict[str, bool]) -> dict[str, tuple]:
    """Every tensor of a 2-layer model of `arch` with the optional groups in `features`."""
    shape = {"token_embd.weight": (VOCAB, DIM), "output_norm.weight": (DIM,), "attn_norm.weight": (DIM,),
             "attn_q.weight": (HEADS * HEAD_DIM, DIM), "attn_k.weight": (KV_HEADS * HEAD_DIM, DIM),
             "attn_v.weight": (KV_HEADS * HEAD_DIM, DIM), "attn_output.weight": (DIM, HEADS * HEAD_DIM),
             "ffn_norm.weight": (DIM,), "ffn_gate.weight": (FFN, DIM), "ffn_up.weight": (FFN, DIM),
             "ffn_down.weight": (DIM, FFN), "attn_q.bias": (HEADS * HEAD_DIM,), "attn_k.bias": (KV_HEADS * HEAD_DIM,),
             "attn_v.bias": (KV_HEADS * HEAD_DIM,), "attn_output.bias": (DIM,), "ffn_gate.bias": (FFN,),
             "ffn_up.bias": (FFN,), "ffn_down.bias": (DIM,), "attn_q_norm.weight": (HEAD_DIM,),
             "attn_k_norm.weight": (HEAD_DIM,), "post_attention_norm.weight": (DIM,), "post_ffw_norm.weight": (DIM,),
             "ffn_gate_inp.weight": (EXPERTS, DIM), "ffn_gate_exps.weight": (EXPERTS, FFN, DIM),
             "ffn_up_exps.weight": (EXPERTS, FFN, DIM), "ffn_down_exps.weight": (EXPERTS, DIM, FFN)}
    parts = list(arch.layer_tensors) + [p for flag, group in _FEATURES.items() if features.get(flag)
                                        for p in group if p in arch.optional_layer_tensors]
    return {**{name: shape[name] for name in arch.global_tensors},
            **{f"blk.{i}.{p}": shape[p] for i in range(2) for p in parts}}


def _write(path, arch, tensors: dict[str, tuple], keys: dict | None = None) -> str:
    w = GGUFWriter(str(path), arch.name)
    w.add_context_length(256)
    w.add_embedding_length(DIM)
    w.add_block_count(2)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    for key, value in {**NEEDED_KEYS.get(arch.name, {}), **(keys or {})}.items():
        {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](f"{arch.name}.{key}", value)
    rng = np.random.default_rng(0)
    for name, shape in tensors.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1 + (len(shape) == 1)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _variants(arch):
    """The feature sets an architecture accepts: none and all of its optional groups."""
    optional = {flag: True for flag, group in _FEATURES.items() if set(group) <= set(arch.optional_layer_tensors)}
    return [{}] + ([optional] if optional else [])


CASES = [(arch, features) for arch in ARCHITECTURES.values() for features in _variants(arch)]
IDS = [f"{arch.name}{'+' + '+'.join(features) if features else ''}" for arch, features in CASES]


@pytest.mark.parametrize("arch, features", CASES, ids=IDS)
def test_every_tensor_is_consumed_and_needed(tmp_path, arch, features):
    tensors = _shapes(arch, features)
    config = GGUFModel(_write(tmp_path / "full.gguf", arch, tensors)).config
    assert config.rope_neox == arch.rope_neox and config.head_dim == HEAD_DIM
    assert config.qk_norm == ("attn_q_norm.weight" in arch.layer_tensors)
    assert config.post_norms == ("post_ffw_norm.weight" in arch.layer_tensors)
    assert config.n_experts == (EXPERTS if arch.moe else 0)
    for flag in ("attn_bias", "attn_out_bias", "ffn_bias", "ffn_down_bias"):
        assert getattr(config, flag) == bool(features.get(flag)), flag
    for name in tensors:  # each one left out is named (in layer 1 it is still in layer 0: an optional one too)
        path = _write(tmp_path / "less.gguf", arch, {n: s for n, s in tensors.items() if n != name})
        with pytest.raises(ModelError, match=f"tensor {re.escape(name)} is missing"):
            GGUFModel(path)
    # a layer too many, an output bias, a shared expert (Qwen2-MoE), another family's FFN kind or
    # optional parts (biases, norms), RoPE factors where the family's graph has none
    ffn_kinds = ["ffn_gate.weight", "ffn_gate_inp.weight", "ffn_down_exps.weight"]
    for extra, shape in [("blk.2.attn_norm.weight", (DIM,)), ("output.bias", (VOCAB,)),
                         ("blk.0.attn_norm.bias", (DIM,)), ("blk.0.ffn_gate_shexp.weight", (FFN, DIM))] + \
            [(f"blk.0.{p}", (8,)) for group in _FEATURES.values() for p in group
             if p not in arch.layer_tensors and p not in arch.optional_layer_tensors] + \
            [(f"blk.0.{p}", (8, DIM)) for p in ffn_kinds if p not in arch.layer_tensors] + \
            [("rope_freqs.weight", (HEAD_DIM // 2,))] * ("rope_freqs.weight" not in arch.optional_global_tensors):
        path = _write(tmp_path / "more.gguf", arch, {**tensors, extra: shape})
        with pytest.raises(ModelError, match=f"tensor {re.escape(extra)} is not used by the {arch.name}"):
            GGUFModel(path)


UNIMPLEMENTED_KEYS = [
    ("attention.sliding_window", 512), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
    ("attention.layer_norm_epsilon", 1e-5), ("attention.scale", 0.125), ("expert_count", 8),
    ("expert_used_count", 2), ("rope.scaling.type", "longrope"), ("rope.scaling.yarn_log_multiplier", 0.1),
    ("rope.dimension_count", 16), ("attention.value_length", 64), ("embedding_scale", 12.0),
    ("rope.scaling.factor", -2.0), ("attention.sliding_window_pattern", 6), ("rope.freq_base_swa", 1e4),
    ("expert_shared_count", 1), ("expert_weights_scale", 2.5), ("expert_gating_func", 2),
    ("expert_shared_feed_forward_length", 64),
]
# what the families that implement a key refuse instead: values outside what is implemented
UNIMPLEMENTED_VALUES = {
    "qwen3moe": [("expert_count", 0), ("expert_used_count", 5), ("expert_count", 300)],
    "gemma3": [("final_logit_softcapping", -1.0), ("rope.scaling.type", "yarn")],
}


@pytest.mark.parametrize("arch", ARCHITECTURES.values(), ids=lambda a: a.name)
def test_math_keys_it_does_not_implement_are_refused(tmp_path, arch):
    tensors = _shapes(arch, {})
    implemented = arch.keys | ({"expert_count", "expert_used_count"} if arch.moe else set())
    refused = [(k, v) for k, v in UNIMPLEMENTED_KEYS if k not in implemented] + UNIMPLEMENTED_VALUES.get(arch.name, [])
    for key, value in refused:
        extra = {"attention.sliding_window": 16} if key == "rope.scaling.type" and value == "yarn" else {}
        path = _write(tmp_path / "m.gguf", arch, tensors, {key: value, **extra})
        with pytest.raises(ModelError, match=f"{arch.name}\\.{re.escape(key)}"):
            GGUFModel(path)


# ------------------------------------------------------------------ across nodes


@pytest.mark.parametrize("name", ["llama-bias", "qwen2", "qwen3", "qwen3moe-tiny", "gemma3-softcap"])
async def test_gather_mode_cluster_equals_one_node(synthetic_model, tokenizer, name):
    """Root + 2 workers in gather mode: biases sliced with their heads, QK-norm scales with them,
    each expert's slice on every node, Gemma's norms and window: every position's target logit
    and best token are the 1-node bits."""
    from .cluster_helpers import in_process_cluster
    from .engine_helpers import text

    model = GGUFModel(synthetic_model(name))
    tokens = tokenizer.encode(text())[:65]
    reference = await our_logits(model, tokens[:-1])
    async with in_process_cluster(model, 2, sync_mode="gather", sync_dtype="f32", ctx=96) as (engine, _):
        positions = await engine.feed(tokens[:-1], SamplingParams(temperature=0.0), targets=tokens[1:])
    for i, per_node in enumerate(positions):
        target = next(s.target_logit for s in per_node if s.target_logit is not None)
        assert np.float32(target) == reference[i, tokens[i + 1]], i
        best = max(per_node, key=lambda s: (s.logits[0], -s.ids[0]))
        assert int(best.ids[0]) == int(reference[i].argmax()), i


# the mixture of experts in the default suite; the others in the slow set (make test-all): what a
# family adds to a cluster is tested in process above (the same daemons and sockets), and what worker
# processes add (the commands, slices streamed between processes) does not depend on the family
@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name == "qwen3moe-tiny" else [pytest.mark.slow])
                                  for name in ["llama-bias", "qwen2", "qwen3-tiny", "qwen3moe-tiny", "gemma3-softcap"]])
def test_each_architecture_across_worker_processes(synthetic_model, name):
    """Root + 2 `dllama worker` processes (--local-workers 2) in gather mode: the perplexity of a
    text (teacher-forced) and the greedy tokens are the 1-node ones. A mixture of experts
    in reduce mode with uneven shares too: each node sums its slice of every expert."""
    from .cluster_helpers import run_dllama
    from .engine_helpers import TEXT_FILE
    from .test_cluster_cli import PROMPT, json_report

    path = synthetic_model(name)

    def run(*nodes: str) -> tuple[float, list[int]]:
        common = ("--model", path, "--threads", "1", "--json", *nodes)
        ppl = json_report(run_dllama("perplexity", "--text-file", str(TEXT_FILE), "--ctx-size", "64",
                                     "--max-tokens", "128", *common))
        greedy = json_report(run_dllama("inference", "-p", PROMPT, "-n", "12", "--temperature", "0", *common))
        assert (ppl["nodes"], greedy["nodes"]) == ((3, 3) if nodes else (1, 1))
        return ppl["perplexity"], greedy["tokens"]

    alone = run()
    gathered = run("--local-workers", "2", "--sync-mode", "gather")
    assert gathered[1] == alone[1]
    # the same logits; each node's share of the softmax normalizer is added in another order
    assert gathered[0] == pytest.approx(alone[0], rel=1e-9)
    if name.startswith("qwen3moe"):
        perplexity, _ = run("--local-workers", "2", "--weights", "2,1,1", "--sync-mode", "reduce")
        assert perplexity == pytest.approx(alone[0], rel=1e-3)
