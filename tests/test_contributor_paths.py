"""The contributor's paths of docs/architectures.md ("Adding a family") and docs/sync.md ("Adding an
all-reduce algorithm"), walked step by step with a toy registered in the test only (monkeypatch),
through the same checks a real family or algorithm goes through, so the guides cannot rot.

The toy family is `xverse`: llama.cpp (the version pyproject.toml pins) runs it and dllama does not
list it. Its graph (llama.cpp's src/models/xverse.cpp) is Llama's without RoPE factors or output and
FFN biases: attn_norm, Q/K/V, output, ffn_norm, gate/up/down, RMSNorm, SwiGLU, normal (non-NeoX)
RoPE, scale 1/sqrt(head_dim), an untied LM head (output.weight is required there). dllama already
computes exactly that for `llama`, so the registration alone is what makes the file run. (llama.cpp
would also take optional Q/K/V biases or a fused QKV; the toy's description has neither, so dllama
refuses such a file rather than ignore them.)

The toy algorithm is "reduce to rank 0 in rank order, then broadcast", built from the base class's
linear collectives; two broken variants show that the collective checks reject a wrong one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dllama.sync.group as sync_group
from dllama.architectures import ARCHITECTURES, Architecture
from dllama.errors import ModelError
from dllama.gguf_model import GGUFModel
from dllama.sync.base import Algorithm

from . import test_architectures as structure
from . import test_fidelity as fidelity
from . import test_sync_collectives as collectives
from .engine_helpers import SYNTHETIC_SPECS

# ------------------------------------------------------------------ adding a family

TOY_FAMILY = "xverse"
# Step 3's entry in SYNTHETIC_SPECS: small Llama-like shapes, Q8_0 (native, so bit for bit where
# llama.cpp takes our kernels' path), an untied LM head as xverse requires, 3 layers
TOY_SPEC = dict(arch=TOY_FAMILY, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256, qtype="Q8_0",
                tied_embeddings=False, seed=31)


@pytest.fixture
def toy_file(synthetic_model, monkeypatch):
    """Step 3: the family's synthetic GGUF, written through SYNTHETIC_SPECS as a real family's is."""
    monkeypatch.setitem(SYNTHETIC_SPECS, TOY_FAMILY, TOY_SPEC)
    return synthetic_model(TOY_FAMILY)


@pytest.fixture
def toy_family(toy_file, monkeypatch):
    """Step 2: its description in ARCHITECTURES (in this test only). Everything xverse's graph does
    is a field of Architecture already: normal RoPE, Llama's default tensors, no optional ones."""
    assert TOY_FAMILY not in ARCHITECTURES, "xverse is registered for real: pick another toy family"
    with pytest.raises(ModelError, match=f"unsupported model architecture '{TOY_FAMILY}'"):
        GGUFModel(toy_file)
    arch = Architecture(TOY_FAMILY, rope_neox=False)
    monkeypatch.setitem(ARCHITECTURES, TOY_FAMILY, arch)
    return arch


def test_toy_family_loads_once_registered_and_passes_the_structural_checks(toy_file, toy_family, tmp_path):
    """Registered, the file loads as the family it is; test_architectures.py's checks (each tensor
    needed, any other refused, unimplemented keys refused) hold for it as for every family."""
    config = GGUFModel(toy_file).config
    assert (config.arch, config.rope_neox, config.n_layers, config.tied_embeddings) == (TOY_FAMILY, False, 3, False)
    structure.test_every_tensor_is_consumed_and_needed(tmp_path, toy_family, {})
    structure.test_math_keys_it_does_not_implement_are_refused(tmp_path, toy_family)


def test_toy_family_logits_match_llama_cpp(toy_file, toy_family, llama_ref, tokenizer, one_compute_thread):
    """Step 4: test_fidelity.py's judgment of a synthetic family, as it is: teacher-forced logits
    bit for bit where llama.cpp takes our kernels' path, else within llama.cpp's own spread."""
    fidelity.test_synthetic_models(lambda name: toy_file, llama_ref, tokenizer, TOY_FAMILY)


def test_toy_family_greedy_tokens_match_llama_cpp(toy_file, toy_family, llama_ref, tokenizer, one_compute_thread):
    """Step 4: 24 greedy tokens through the Generator against llama.cpp's token-by-token decode."""
    fidelity.test_synthetic_architectures_greedy(lambda name: toy_file, llama_ref, tokenizer, TOY_FAMILY)


def test_a_misread_description_fails_the_fidelity_judgment(toy_file, toy_family, llama_ref, tokenizer,
                                                           one_compute_thread, monkeypatch):
    """Step 1 matters: described with NeoX RoPE (llama.cpp's rope type misread), the same file's
    logits leave llama.cpp's spread, and the judgment above fails."""
    monkeypatch.setitem(ARCHITECTURES, TOY_FAMILY, dataclasses.replace(toy_family, rope_neox=True))
    with pytest.raises(AssertionError):
        fidelity.test_synthetic_models(lambda name: toy_file, llama_ref, tokenizer, TOY_FAMILY)


# ------------------------------------------------------------------ adding an all-reduce algorithm


class GatherBroadcast(Algorithm):
    """Step 1 (docs/sync.md shows this class): every partial to rank 0, summed there in rank order,
    the result broadcast as it is."""

    name = "gather-broadcast"

    @staticmethod
    def encodings(p):
        return 1  # each partial is encoded once; the result travels as plain values

    async def all_reduce(self, red):
        await self.reduce(red, 0)  # base.py: linear reduce to rank 0, in rank order
        await self.broadcast(red.a8, 0)  # base.py: rank 0's bytes to every rank


class ForgetsTheBroadcast(GatherBroadcast):
    """Broken: only rank 0 ends with the sum."""

    name = "forgets-the-broadcast"

    async def all_reduce(self, red):
        await self.reduce(red, 0)


class SumsItsOwnFirst(GatherBroadcast):
    """Broken, subtly: every rank sums all partials itself (as mesh does), but its own first and
    then the others in rank order. Exact inputs give the exact sum anyway; float sums in different
    orders leave the ranks a last bit apart, which only the all-ranks-identical check sees."""

    name = "sums-its-own-first"

    async def all_reduce(self, red):
        c = self.comm
        p, me = c.size, c.rank
        futs = [c.irecv(r, red.partial_buffer(0, red.n, r)) for r in range(p) if r != me]
        own = red.stage_own(0, red.n, me)
        for r in range(p):
            if r != me:
                c.send(r, own)
        for f in futs:
            await f
        red.combine(0, red.n, [me] + [r for r in range(p) if r != me])


@pytest.fixture
def register(monkeypatch):
    """Step 2: ALGORITHMS in dllama/sync/group.py (in this test only), and ALGO_NAMES, which
    group.py derives from it when it is imported."""
    def add(cls) -> str:
        assert cls.name not in sync_group.ALGORITHMS
        monkeypatch.setitem(sync_group.ALGORITHMS, cls.name, cls)
        monkeypatch.setattr(sync_group, "ALGO_NAMES", tuple(sync_group.ALGORITHMS) + ("auto",))
        return cls.name
    return add


@pytest.mark.parametrize("p", [1, 2, 3, 5])
async def test_toy_algorithm_passes_the_collective_checks(register, p):
    """Step 3: test_sync_collectives.py's matrix, as every algorithm runs it (every collective,
    awkward lengths, every op, exact inputs with zero tolerance, all ranks bit-identical, the codecs
    within their bounds), with the toy as the group's algorithm."""
    name = register(GatherBroadcast)
    assert sync_group.algo_name(name) == name
    await collectives.test_every_collective(name, p)


@pytest.mark.parametrize("broken", [ForgetsTheBroadcast, SumsItsOwnFirst], ids=lambda cls: cls.name)
async def test_the_collective_checks_reject_a_broken_algorithm(register, broken):
    with pytest.raises(AssertionError):
        await collectives.test_every_collective(register(broken), 3)


async def test_the_subtle_break_is_exact_on_exact_inputs(register):
    """The broken variant above is caught by the bit-identity of float results, not by the values:
    on exact inputs it gives the exact sum on every rank (so a check of values alone would pass)."""
    from dllama.sync import local_cluster

    from .sync_helpers import exact_inputs, on_all

    name = register(SumsItsOwnFirst)
    async with local_cluster(3, algo=name, timeout=20) as groups:
        outs = await on_all(groups, lambda g, r: g.all_reduce(exact_inputs(257, r, np.float32)))
    assert all(np.array_equal(out, collectives.reference("sum", 257, 3, np.float32)) for out in outs)
