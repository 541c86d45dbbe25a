"""What a program must compute and move, from the shapes alone: the arithmetic a plan checks XLA's cost analysis
against and prices with.

FLOPs count multiply-adds twice: a token through a matmul of W weights is 2W; attention over c positions per query
head is 4 c hd (scores and the weighted sum). Norms, RoPE and softmax are left out (a few per cent). A sparse MoE
layer computes its experts as the model's dispatch rule does (kvjax.models.qwen3_moe): every expert on every token
when dense (what "auto" picks above decode-sized token counts), top-k of them when routed.

Bytes are the least a call moves through HBM: every weight it uses read once, the cache positions attention reads,
the positions written. Activations are left out: a prefill is compute-bound long before they matter, and a decode
step's are small. All figures here are totals over the slice; kvjax.plan.programs divides them per device.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from kvjax.models.params import param_specs


def _size(shape) -> int:
    return math.prod(shape)


def layer_weights(cfg, tokens: int | None = None) -> float:
    """Weights one token multiplies by in the decoder layers (all layers): dense layers' q/k/v/o and MLP; a sparse
    layer's router and the experts its dispatch runs (`tokens`: how many tokens the call routes, which picks the
    dispatch under "auto"; None: routed, the active experts)."""
    experts = getattr(cfg, "num_experts", 0)
    share = 1.0
    if experts:
        from kvjax.models.qwen3_moe import dispatch_for
        mode = "gathered" if tokens is None else dispatch_for(cfg, tokens)
        share = 1.0 if mode == "dense" else cfg.num_experts_per_tok / experts
    total = 0.0
    for name, s in param_specs(cfg).items():
        if not name.startswith("layers.") or len(s.shape) < 2:
            continue
        total += _size(s.shape) * (share if "experts" in s.axes else 1.0)
    return total


def head_weights(cfg) -> int:
    return cfg.vocab_size * cfg.hidden_size


def forward_flops(cfg, rows: int, tokens: int, context: float, logit_tokens: int) -> float:
    """A forward pass of `tokens` new tokens per row over `context` cached-or-new positions each attends to on
    average (a fresh causal prefill of T: (T + 1) / 2), the head applied to `logit_tokens` tokens per row."""
    n = rows * tokens
    attn = 4.0 * n * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2.0 * n * layer_weights(cfg, n) + attn + 2.0 * rows * logit_tokens * head_weights(cfg)


def weight_bytes(cfg, itemsize: int, tokens: int | None = None, logits: bool = True) -> float:
    """Weight bytes a call reads: the layers' (the experts its dispatch touches) and, with logits, the head (the
    embedding rows it gathers are few)."""
    head = head_weights(cfg) if logits else 0
    return (layer_weights(cfg, tokens) + head) * itemsize


def kv_bytes(cfg, rows: int, positions: float, itemsize: int) -> float:
    """Keys and values of `positions` positions per row, every layer."""
    return 2.0 * rows * positions * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def map_flops(kvmap, rows: int, positions: int) -> float:
    """The map on `positions` positions per row: per target layer and kind, (x - mu) @ w_in @ w_out and the
    residual's down / up (a context map's previous positions and a cross-position map's attention added)."""
    total = 0.0
    for m in (*kvmap.keys, *kvmap.values):
        fx, r = m.w_in.shape
        fy, h = m.w_out.shape[1], m.down.shape[1]
        per = fx * r + r * fy + fx * h + h * fy
        if m.down_prev is not None:
            per += m.down_prev.shape[0] * fx * h
        if m.att_q is not None:
            a, _, d = m.att_q.shape
            per += 3 * a * fx * d + a * d * h + a * d * positions  # projections, output, scores over the prefix
        total += 2.0 * rows * positions * per
    return total


def map_weight_bytes(kvmap) -> float:
    return float(sum(_size(x.shape) * jnp.dtype(x.dtype).itemsize for x in
                     [leaf for m in (*kvmap.keys, *kvmap.values) for leaf in (m.w_in, m.w_out, m.down, m.up)]))


def stats_flops(fx: int, fy: int, n: int) -> float:
    """Second moments of n (x, residual) feature rows: x'x, x'r, r'r."""
    return 2.0 * n * (fx * fx + fx * fy + fy * fy)
