"""One node's slice of a llama-style transformer: its weights, its KV cache, its forward pass.

The same code runs on every node. A 1-node run is the shard that holds everything, with
collectives that return their input. Per layer there are exactly two sync points: the attention
output and the FFN down projections, made whole across nodes (by an all-reduce of partial sums,
or by all-gathers: see projection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow, DllamaError
from .gguf_model import GGUFModel
from .kernels.activations import Activations
from .kernels.attention import CacheSpans, attend
from .kernels.ops import gelu_mul, rmsnorm, rope_angles, rotate, silu_mul, softcap
from .moe import RoutedDown, expert_activations, route
from .kv_cache import KVCache, round_capacity
from .plan import Shard, slice_peak_bytes
from .quant import FORMATS
from .projection import ALONE, Collectives, Gather, Reduce
from .weights import Experts, Matrix, stack_rows


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: Matrix  # rows: this node's query heads
    wk: Matrix  # rows: the KV heads those query heads read
    wv: Matrix
    wo: Matrix  # columns: this node's query heads (gather mode: rows: its output rows)
    ffn_norm: np.ndarray
    # the FFN: one (Matrix), or in a mixture of experts the same slice of each expert (Experts)
    w_gate: Matrix | Experts  # rows: this node's FFN hidden units
    w_up: Matrix | Experts
    w_down: Matrix | Experts  # columns: this node's FFN hidden units (gather mode: rows: its output rows)
    # what some architectures add (architectures.py); None where the model has none
    bq: np.ndarray | None = None  # Q/K/V biases, sliced with the heads
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None  # attention output bias, whole (added once the projection is whole)
    b_gate: np.ndarray | None = None  # FFN biases: gate and up sliced with the hidden units, down whole
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # per-head RMS norm scales of Q and K (head_dim each)
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None  # RMS norms of the whole attention / FFN output (Gemma)
    ffn_post_norm: np.ndarray | None = None
    router: Matrix | None = None  # a mixture of experts' router (n_experts rows), whole on every node
    # wq, wk, wv (w_gate, w_up) as one matrix where they can share one (weights.stack_rows: they are
    # views of it); not counted again in nbytes
    wqkv: Matrix | None = None
    w_gate_up: Matrix | None = None


_STACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


@dataclass
class ShardWeights:
    layers: list[LayerWeights]
    output_norm: np.ndarray
    lm_head: Matrix  # rows: this node's vocabulary slice
    rope_freq_factors: np.ndarray | None

    @classmethod
    def from_gguf(cls, model: GGUFModel, shard: Shard, mode: str = "reduce") -> "ShardWeights":
        """This shard's slices of the (memory-mapped) file. The matrices of the block formats
        are packed into RAM for the kernels (kernels/packing.py), one at a time, each
        releasing its pages of the map, so RAM holds the weights once (not those converted on load:
        the model keeps the converted copy, and a second would double them); other native types stay
        views of the map, except column slices (reduce mode's Wo and W2 on a node of several):
        read from the map, every row's part is a jump away from the last, which defeats the CPU's
        prefetching (5.3 vs 14-16 GB/s on a 1B model's W2), so they are copied once into RAM, and
        the vectors (norms, biases: KBs)."""
        tensors = {}
        for name, t in shard_tensors(model, shard, mode):
            if isinstance(t, Matrix) and model.file.maps(t.data):
                packed = packed_for_kernels(name, t)
                if packed is not t:
                    model.file.release(t.data)
                    t = packed
            if isinstance(t, (Matrix, Experts)) and isinstance(t.data, np.ndarray) \
                    and t.data.strides[-2] != t.data.shape[-1] * t.data.itemsize:
                t = t.contiguous()  # rows with gaps between them (a row slice of experts has none)
            elif isinstance(t, np.ndarray):
                t = t.copy()  # a norm or a bias: read from the map, it maps a whole folio (up to 2 MB) around it
            tensors[name] = t
        model.file.release()  # the folios those reads mapped; what is still read from the map comes back
        return cls.from_tensors(tensors)

    @classmethod
    def from_tensors(cls, t: dict[str, Matrix | Experts | np.ndarray]) -> "ShardWeights":
        """From `shard_tensors`' names; expert stacks may come as one matrix each (as they travel).
        Takes the layers' tensors out of t, so that matrices stacked into one (stack_rows) are freed
        layer by layer as their copy is made (peak RAM: the weights and one layer's stack)."""
        layers: dict[int, dict] = {}
        for name in [name for name in t if name.startswith("blk.")]:
            _, index, part = name.split(".", 2)
            layers.setdefault(int(index), {})[_FIELD[part]] = t.pop(name)
        for fields in layers.values():
            if fields.get("router") is not None:
                for key in ("w_gate", "w_up", "w_down"):
                    if isinstance(fields[key], Matrix):
                        fields[key] = Experts.of(fields[key], fields["router"].rows)
            for stacked, parts in _STACKED.items():
                if all(isinstance(fields.get(part), Matrix) for part in parts):
                    both = stack_rows([fields[part] for part in parts])
                    if both is not None:
                        fields[stacked], views = both
                        fields.update(zip(parts, views))
        return cls([LayerWeights(**layers[i]) for i in range(len(layers))], t["output_norm"], t["output"],
                   t.get("rope_freqs"))

    @property
    def nbytes(self) -> int:
        total = self.lm_head.nbytes + self.output_norm.nbytes
        for layer in self.layers:
            for name, value in vars(layer).items():
                total += 0 if value is None or name in _STACKED else value.nbytes
        return total


def split_columns(products: np.ndarray, at: tuple[int, ...]) -> list[np.ndarray]:
    """A stacked matrix's products (T, rows) cut back into each matrix's (T, its rows), contiguous
    (a view for one token, a copy for several: the kernels after them take rows without gaps)."""
    bounds = (0, *at, products.shape[1])
    return [np.ascontiguousarray(products[:, a:b]) for a, b in zip(bounds, bounds[1:])]


def packed_for_kernels(name: str, tensor):
    """A weight matrix as the kernels read it fastest (`Matrix.packed`); anything else, and the
    expert stacks (sliced per expert, kernels per expert matrix), as it is."""
    return tensor.packed() if isinstance(tensor, Matrix) and not name.endswith("_exps") else tensor


# shard_tensors' names of a layer's parts -> LayerWeights fields
_FIELD = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
          "ffn_norm": "ffn_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
          "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv", "attn_output.bias": "bo",
          "ffn_gate.bias": "b_gate", "ffn_up.bias": "b_up", "ffn_down.bias": "b_down",
          "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
          "post_attention_norm": "attn_post_norm", "post_ffw_norm": "ffn_post_norm",
          "ffn_gate_inp": "router", "ffn_gate_exps": "w_gate", "ffn_up_exps": "w_up", "ffn_down_exps": "w_down"}


def shard_peak_bytes(model: GGUFModel, shard: Shard, mode: str = "reduce") -> int:
    """What a node holding `shard` needs for its tensors while it loads (plan.slice_peak_bytes)."""
    return slice_peak_bytes([t.nbytes for _name, t in shard_tensors(model, shard, mode)])


def shard_tensors(model: GGUFModel, shard: Shard,
                  mode: str = "reduce") -> Iterator[tuple[str, Matrix | np.ndarray]]:
    """(name, tensor) for every tensor of a shard, cut from the full model. Names are the GGUF
    names without '.weight'; the LM head is always 'output'. mode: how Wo and W2 are cut
    (reduce: by the columns of this node's heads / hidden units; gather: by its output rows)."""
    hd = model.config.head_dim
    q0, q1 = (h * hd for h in shard.q_heads)
    k0, k1 = (h * hd for h in shard.kv_heads)
    f0, f1 = shard.ffn
    by_rows = mode == "gather"
    for i in range(model.config.n_layers):
        def m(part):
            return model.matrix(model.layer_name(i, part))

        yield f"blk.{i}.attn_norm", model.vector(model.layer_name(i, "attn_norm"))
        yield f"blk.{i}.attn_q", m("attn_q").row_slice(q0, q1)
        yield f"blk.{i}.attn_k", m("attn_k").row_slice(k0, k1)
        yield f"blk.{i}.attn_v", m("attn_v").row_slice(k0, k1)
        if model.config.attn_bias:
            yield f"blk.{i}.attn_q.bias", model.vector(f"blk.{i}.attn_q.bias")[q0:q1]
            yield f"blk.{i}.attn_k.bias", model.vector(f"blk.{i}.attn_k.bias")[k0:k1]
            yield f"blk.{i}.attn_v.bias", model.vector(f"blk.{i}.attn_v.bias")[k0:k1]
        if model.config.attn_out_bias:
            yield f"blk.{i}.attn_output.bias", model.vector(f"blk.{i}.attn_output.bias")
        if model.config.qk_norm:
            yield f"blk.{i}.attn_q_norm", model.vector(model.layer_name(i, "attn_q_norm"))
            yield f"blk.{i}.attn_k_norm", model.vector(model.layer_name(i, "attn_k_norm"))
        wo = m("attn_output")
        yield f"blk.{i}.attn_output", wo.row_slice(*shard.rows) if by_rows else _head_columns(wo, q0, q1, shard)
        if model.config.post_norms:
            yield f"blk.{i}.post_attention_norm", model.vector(model.layer_name(i, "post_attention_norm"))
            yield f"blk.{i}.post_ffw_norm", model.vector(model.layer_name(i, "post_ffw_norm"))
        yield f"blk.{i}.ffn_norm", model.vector(model.layer_name(i, "ffn_norm"))
        if model.config.n_experts:  # the same slice of every expert; the router whole
            yield f"blk.{i}.ffn_gate_inp", m("ffn_gate_inp")
            ffn = "_exps"
            gate, up, down = (model.experts(model.layer_name(i, part + ffn))
                              for part in ("ffn_gate", "ffn_up", "ffn_down"))
        else:
            ffn = ""
            gate, up, down = m("ffn_gate"), m("ffn_up"), m("ffn_down")
        yield f"blk.{i}.ffn_gate{ffn}", gate.row_slice(f0, f1)
        yield f"blk.{i}.ffn_up{ffn}", up.row_slice(f0, f1)
        yield f"blk.{i}.ffn_down{ffn}", down.row_slice(*shard.rows) if by_rows else down.col_slice(f0, f1)
        if model.config.ffn_bias:
            yield f"blk.{i}.ffn_gate.bias", model.vector(f"blk.{i}.ffn_gate.bias")[f0:f1]
            yield f"blk.{i}.ffn_up.bias", model.vector(f"blk.{i}.ffn_up.bias")[f0:f1]
        if model.config.ffn_down_bias:
            yield f"blk.{i}.ffn_down.bias", model.vector(f"blk.{i}.ffn_down.bias")
    yield "output_norm", model.vector("output_norm.weight")
    yield "output", model.matrix(model.lm_head_name).row_slice(*shard.vocab)
    freqs = model.rope_freq_factors()
    if freqs is not None:
        yield "rope_freqs", freqs


def _head_columns(wo: Matrix, start: int, stop: int, shard: Shard) -> Matrix:
    """Wo's columns of a node's heads (reduce mode), which must fall on the format's blocks."""
    try:
        return wo.col_slice(start, stop)
    except ValueError:
        raise DllamaError(f"the attention output is {wo.qtype.name}: its columns are cut in blocks of "
                          f"{FORMATS[wo.qtype].block_size}, but node {shard.node}'s heads are columns {start}-{stop}; "
                          "use --sync-mode gather (rows), or --weights that give it whole blocks") from None


class Span(NamedTuple):
    """A sequence's tokens in a forward pass: n tokens at positions start.. of the sequence in `slot`."""

    slot: int
    start: int
    n: int


class ShardModel:
    """A node's slice of the transformer, with the KV caches of its heads (one per sequence slot).

    projection: how the output projections are split and made whole (projection.Reduce, the
    default, or projection.Gather); it must match how the weights were cut (shard_tensors).
    slots: sequences that may decode together; kv_budget: positions their caches may hold in all
    (default: every slot a whole context)."""

    def __init__(self, config: ModelConfig, shard: Shard, weights: ShardWeights, ctx_size: int,
                 projection: Reduce | Gather = Reduce(), slots: int = 1, kv_budget: int | None = None):
        self.config, self.shard, self.weights, self.ctx_size = config, shard, weights, ctx_size
        self.projection = projection
        g = config.group_size
        self.kv_of_head = np.arange(*shard.q_heads, dtype=np.int64) // g - shard.kv_heads[0]
        budget = round_capacity(ctx_size) * slots if kv_budget is None else kv_budget
        self.kv = KVCache(config, shard.n_kv_heads, slots, ctx_size, budget)
        # per layer, worked out once (a decode step of a small model spends ~10 us a layer asking)
        self.ropes = list(dict.fromkeys(config.rope_of_layer(i) for i in range(config.n_layers)))  # (base, scaling)
        self.rope_of_layer = [self.ropes.index(config.rope_of_layer(i)) for i in range(config.n_layers)]
        self.window_of_layer = [config.sliding_window if config.is_local(i) else 0 for i in range(config.n_layers)]

    async def forward(self, x: np.ndarray, spans: list[Span], comm: Collectives = ALONE,
                      copies: list[tuple[int, int, int]] = (), out_rows: np.ndarray | None = None) -> np.ndarray:
        """Run tokens through every layer, filling the KV caches: x (T, dim) holds the embeddings of
        every span's tokens, one span after another (each span a sequence, its cache in its slot).
        copies (src, dst, n): in each layer, once the tokens' keys and values are in, slot dst takes
        slot src's first n positions (a prompt start that src has, or computes in this pass).
        Returns the final residual stream (T, dim), the same on every node; with out_rows (indices
        into T, the same on every node) only those rows, in that order: the last layer, once its keys
        and values are in, runs its attention's output projection and feed-forward for them alone
        (as llama.cpp does for the tokens whose logits nobody asks: a prompt's all but its last).
        Every kernel sums a token's values in one order whatever T is, so a token's result does not
        depend on how the tokens were split into forward passes, nor on the other sequences that
        share one."""
        cfg, hd = self.config, self.config.head_dim
        T = x.shape[0]
        if sum(s.n for s in spans) != T:
            raise ValueError(f"the spans hold {sum(s.n for s in spans)} tokens, x {T}")
        for s in spans:
            if s.start + s.n > self.kv.capacity(s.slot):
                raise ContextOverflow(f"{s.start + s.n} tokens do not fit the {self.kv.capacity(s.slot)} positions "
                                      f"of slot {s.slot}'s KV cache")
        for src, dst, n in copies:
            if n > min(self.kv.capacity(src), self.kv.capacity(dst)):
                raise ContextOverflow(f"slots {src} -> {dst} hold {self.kv.capacity(src)} and {self.kv.capacity(dst)} "
                                      f"positions, not the {n} to copy")
        x = np.array(x, dtype=np.float32)
        if cfg.embedding_scale != 1.0:  # Gemma
            x *= np.float32(cfg.embedding_scale)
        pos = np.concatenate([np.arange(s.start, s.start + s.n) for s in spans])
        nq, nkv = self.shard.n_q_heads, self.shard.n_kv_heads
        kv = self.kv
        caches = CacheSpans([kv.k[s.slot] for s in spans], [kv.v[s.slot] for s in spans], [s.start for s in spans],
                            [s.n for s in spans], [((kv.k[src], kv.v[src]), (kv.k[dst], kv.v[dst]), n)
                                                   for src, dst, n in copies]) if nq else None
        project = self.projection.project
        angles = {}  # RoPE's cos/sin tables of the tokens' positions, by index in self.ropes
        gate = gelu_mul if cfg.activation == "gelu" else silu_mul
        for i, w in enumerate(self.weights.layers):
            # attention over this node's heads
            h = Activations(rmsnorm(x, w.attn_norm, cfg.norm_eps))
            if nq:
                if w.wqkv is not None:  # one product for the three
                    q, k, v = split_columns(w.wqkv.matmul(h), (w.wq.rows, w.wq.rows + w.wk.rows))
                else:
                    q, k, v = w.wq.matmul(h), w.wk.matmul(h), w.wv.matmul(h)
                if w.bq is not None:  # Qwen2, some Llama GGUFs
                    q += w.bq
                    k += w.bk
                    v += w.bv
                q, k, v = q.reshape(T, nq, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
                if w.q_norm is not None:  # Qwen3, Gemma 3: each head RMS-normed before RoPE
                    q = rmsnorm(q.reshape(T * nq, hd), w.q_norm, cfg.norm_eps).reshape(T, nq, hd)
                    k = rmsnorm(k.reshape(T * nkv, hd), w.k_norm, cfg.norm_eps).reshape(T, nkv, hd)
                rope = self.rope_of_layer[i]  # the same tables for every layer that shares a (base, scaling)
                if rope not in angles:
                    base, scaling = self.ropes[rope]
                    angles[rope] = rope_angles(pos, cfg.rope_dims, base, self.weights.rope_freq_factors, scaling)
                rotate(q, angles[rope], cfg.rope_neox)
                rotate(k, angles[rope], cfg.rope_neox)
                if cfg.attn_q_scale:  # Gemma scales Q, not the scores
                    q *= np.float32(cfg.attn_q_scale)
                scale, window = 1.0 if cfg.attn_q_scale else None, self.window_of_layer[i]
                # each sequence's keys and values into its own cache, its queries against it
                att = attend(q, k, v, caches, i, self.kv_of_head, scale, window).reshape(T, nq * hd)
            else:
                att = np.zeros((T, 0), np.float32)
            if out_rows is not None and i == cfg.n_layers - 1:  # past the last keys and values: the rows asked
                x, att = x[out_rows], att[out_rows]
            out = await project(w.wo, att, "att", comm)  # sync point 1: Wo @ att, all heads
            if w.bo is not None:
                out += w.bo
            if w.attn_post_norm is not None:  # Gemma
                out = rmsnorm(out, w.attn_post_norm, cfg.norm_eps)
            x += out

            # feed-forward over this node's hidden units (of each expert, in a mixture of experts)
            h = Activations(rmsnorm(x, w.ffn_norm, cfg.norm_eps))
            if w.router is None:
                if w.w_gate_up is not None:  # one product: gate and up side by side, gated where they are
                    both = w.w_gate_up.matmul(h)
                    if w.b_gate is not None:  # some Llama GGUFs
                        both += np.concatenate([w.b_gate, w.b_up])
                    a = gate(both)
                else:
                    g, u = w.w_gate.matmul(h), w.w_up.matmul(h)
                    if w.b_gate is not None:
                        g += w.b_gate
                        u += w.b_up
                    a = gate(g, u)
                down = w.w_down
            else:  # the router is whole on every node, so all nodes pick the same experts
                routes = route(w.router.matmul(h), cfg.n_experts_used)
                a, down = expert_activations(h, routes, w.w_gate, w.w_up), RoutedDown(w.w_down, routes)
            out = await project(down, a, "ffn", comm)  # sync point 2: W2 @ a, all hidden units
            if w.b_down is not None:
                out += w.b_down
            if w.ffn_post_norm is not None:  # Gemma
                out = rmsnorm(out, w.ffn_post_norm, cfg.norm_eps)
            x += out
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        """This node's slice of the logits (T, vocab slice) for final residual rows x (T, dim)."""
        logits = self.weights.lm_head.matmul(rmsnorm(x, self.weights.output_norm, self.config.norm_eps))
        if self.config.logit_softcap:  # Gemma 2 style, where a Gemma 3 GGUF asks for it
            logits = softcap(logits, self.config.logit_softcap)
        return logits
