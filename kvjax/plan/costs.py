"""What a program must compute and move, from the shapes alone: the arithmetic a plan checks XLA's cost analysis
against and prices with.

Per device: a matmul's FLOPs and weight bytes are those of the weight's shard on the device (a dimension the mesh
axis does not divide is replicated, so every device does all of it: `per_device`), and the tokens are those of the
device's rows (the data axis splits the batch).

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


def per_device(model, tokens: int | None = None, itemsize: int | None = None) -> tuple[float, float, float]:
    """(layer matmul weights, head weights, attention heads) one device holds of an abstract, sharded model: the
    elements of its shard of every decoder-layer matrix (a sparse layer's experts weighted by the share its dispatch
    runs, as `layer_weights`), of the head (lm_head, or the tied embedding), and the query heads it attends with."""
    cfg, params = model
    experts = getattr(cfg, "num_experts", 0)
    share = 1.0
    if experts:
        from kvjax.models.qwen3_moe import dispatch_for
        mode = "gathered" if tokens is None else dispatch_for(cfg, tokens)
        share = 1.0 if mode == "dense" else cfg.num_experts_per_tok / experts
    import jax
    layers = 0.0
    for lp in params.layers:
        for x in jax.tree.leaves(lp):
            if len(x.shape) < 2:
                continue
            n = _size(x.sharding.shard_shape(x.shape)) if getattr(x, "sharding", None) is not None else _size(x.shape)
            layers += n * (share if len(x.shape) == 3 and experts and x.shape[0] == experts else 1.0)
    head = params.embed if params.lm_head is None else params.lm_head
    head_n = _size(head.sharding.shard_shape(head.shape)) if getattr(head, "sharding", None) is not None \
        else _size(head.shape)
    q = params.layers[0].q
    heads = q.sharding.shard_shape(q.shape)[1] if getattr(q, "sharding", None) is not None else q.shape[1]
    return layers, float(head_n), float(heads)


def device_forward_flops(model, rows: int, tokens: int, context: float, logit_tokens: int, data: int = 1) -> float:
    """`forward_flops` for one device of a sharded model: its weight shards, its query heads, its share of the rows
    (`data`: the data axis size; rows it does not divide are replicated)."""
    cfg = model[0]
    rows_dev = rows / data if rows % data == 0 else rows
    n = rows_dev * tokens
    layers, head, heads = per_device(model, int(rows * tokens))
    attn = 4.0 * n * context * heads * cfg.head_dim * cfg.num_layers
    return 2.0 * n * layers + attn + 2.0 * rows_dev * logit_tokens * head


def device_weight_bytes(model, itemsize: int, tokens: int | None = None, logits: bool = True) -> float:
    """Weight bytes one device reads in a call: its shards of the layers (the experts the dispatch touches) and,
    with logits, of the head."""
    layers, head, _ = per_device(model, tokens)
    return (layers + (head if logits else 0.0)) * itemsize


def stats_flops(fx: int, fy: int, n: int) -> float:
    """Second moments of n (x, residual) feature rows: x'x, x'r, r'r."""
    return 2.0 * n * (fx * fx + fx * fy + fy * fy)
