"""The mixture-of-experts pieces against plain numpy: routing, the expert FFN, a node's slice of
every expert (column slices add up to the whole), and the plan's bytes per node. (Against
llama.cpp: test_fidelity.py's qwen3moe models.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dllama.cluster.slices import from_bytes, make_entry, tensor_bytes
from dllama.kernels.activations import Activations
from dllama.kernels.attention import softmax_ref
from dllama.kernels.ops import silu_mul_ref
from dllama.moe import RoutedDown, expert_activations, route
from dllama.quant import QType, quantize
from dllama.weights import Experts, Matrix

from .test_cli import dllama

N_EXPERTS, DIM, HIDDEN = 8, 64, 96


def _experts(rng, rows, cols, qtype=QType.Q8_0) -> Experts:
    values = (rng.standard_normal((N_EXPERTS * rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return Experts.of(Matrix(qtype, N_EXPERTS * rows, cols, quantize(values, qtype)), N_EXPERTS)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_route_picks_the_top_k_and_renormalizes(k):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((5, N_EXPERTS)).astype(np.float32) * 3
    routes = route(logits, k)
    probs = softmax_ref(logits)
    for t in range(5):
        expected = np.argsort(-probs[t], kind="stable")[:k]
        assert list(routes.experts[t]) == list(expected)  # most probable first
        np.testing.assert_allclose(routes.weights[t], probs[t][expected] / probs[t][expected].sum(), rtol=1e-5)
        assert routes.weights.dtype == np.float32 and abs(routes.weights[t].sum() - 1) < 1e-6


def test_expert_ffn_equals_each_token_s_experts_summed():
    rng = np.random.default_rng(1)
    gate, up, down = _experts(rng, HIDDEN, DIM), _experts(rng, HIDDEN, DIM), _experts(rng, DIM, HIDDEN)
    h = rng.standard_normal((6, DIM)).astype(np.float32)
    routes = route(rng.standard_normal((6, N_EXPERTS)).astype(np.float32) * 3, 3)
    a = expert_activations(Activations(h), routes, gate, up)
    out = RoutedDown(down, routes).matmul(a)
    for t in range(6):
        want = np.zeros(DIM)
        for j, e in enumerate(routes.experts[t]):
            g, u = gate[int(e)].matmul(h[t]), up[int(e)].matmul(h[t])
            act = silu_mul_ref(g[None], u[None])
            np.testing.assert_allclose(a[t * 3 + j], act[0], rtol=1e-5, atol=1e-6)
            want += routes.weights[t, j] * down[int(e)].matmul(a[t * 3 + j]).astype(np.float64)
        np.testing.assert_allclose(out[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.F16, QType.F32], ids=lambda q: q.name)
def test_a_node_s_slice_of_every_expert_adds_up_to_the_whole(qtype):
    """Reduce mode: nodes hold hidden units [0, 32) and [32, 96) of every expert; their partial
    outputs (wide: float64) add up to the whole layer's."""
    rng = np.random.default_rng(2)
    gate, up, down = (_experts(rng, HIDDEN, DIM, qtype), _experts(rng, HIDDEN, DIM, qtype),
                      _experts(rng, DIM, HIDDEN, qtype))
    h = Activations(rng.standard_normal((4, DIM)).astype(np.float32))
    routes = route(rng.standard_normal((4, N_EXPERTS)).astype(np.float32) * 3, 2)
    whole = RoutedDown(down, routes).matmul(expert_activations(h, routes, gate, up), wide=True)
    parts = []
    for f0, f1 in [(0, 32), (32, 96)]:
        a = expert_activations(h, routes, gate.row_slice(f0, f1), up.row_slice(f0, f1))
        parts.append(RoutedDown(down.col_slice(f0, f1), routes).matmul(a, wide=True))
        assert gate.row_slice(f0, f1).nbytes == gate.nbytes * (f1 - f0) // HIDDEN
    np.testing.assert_allclose(parts[0] + parts[1], whole, rtol=1e-9, atol=1e-9)
    # slices are views of the stack: no copy of any expert
    assert np.shares_memory(gate.row_slice(32, 96).data, gate.data)
    # as it travels to a worker: one matrix of every expert's rows, expert after expert, and back
    sliced = gate.row_slice(32, 96)
    arrived = from_bytes(make_entry("blk.0.ffn_gate_exps", sliced), tensor_bytes(sliced).copy())
    again = Experts.of(arrived, N_EXPERTS)
    np.testing.assert_array_equal(again.data, sliced.data)


def test_models_plan_reports_each_node_s_share_of_every_expert(synthetic_model):
    path = synthetic_model("qwen3moe-top2")
    rows = {}
    for nodes, weights in [(1, None), (3, "2,1,1")]:
        result = dllama("models", "plan", path, "--nodes", str(nodes), *(["--weights", weights] if weights else []))
        assert result.returncode == 0, result.stderr
        assert "16 experts (top-2) of 768 units" in result.stdout
        rows[nodes] = [line.split() for line in result.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [r[3] for r in rows[3]] == ["0-383", "384-575", "576-767"]  # FFN units of every expert
    held = [float(r[-1]) for r in rows[3]]
    # the shares add up to the whole, plus what every node keeps a copy of (router, norms, a KV
    # head that two nodes' query heads read)
    whole = float(rows[1][0][-1])
    assert whole <= sum(held) <= 1.01 * whole and held[0] > 1.9 * held[1]
