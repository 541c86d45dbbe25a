"""The Qwen3-MoE family (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3's attention (QK-norm, no biases, plain
RoPE) with sparse mixture-of-experts MLPs in some layers.

Layer i is sparse when `num_experts > 0`, i is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`;
other layers keep Qwen3's dense SwiGLU MLP of width `intermediate_size` (their params are kvjax.models.qwen3's
LayerParams). A sparse layer's router scores the experts (softmax in float32 over `num_experts` logits), keeps the
`num_experts_per_tok` best, renormalises their probabilities when `norm_topk_prob`, and sums those experts' SwiGLU
outputs (width `moe_intermediate_size`) weighted by them, as transformers' Qwen3MoeSparseMoeBlock does.

Dispatch (`Qwen3MoeConfig.moe_dispatch`, static, not part of the checkpoint):
  "dense"  every expert runs on every token and the unchosen ones get weight zero: one big matmul, exact, the
           reference the tests compare against, and the training step (24-28 s vs 32-41 s for "routed" at
           8 x 1024 tokens on the toy MoE, launch/toy/config.py).
  "routed" only the chosen experts' work: with few routed tokens (decode: tokens x top-k <= experts / 2) each token
           gathers its k experts' weights and multiplies by them alone, reading k/E of the expert weights; with
           many tokens (prefill) the (token, expert) pairs are sorted by expert and run as one grouped matmul
           (jax.lax.ragged_dot), which does top-k/E of the dense FLOPs.
  "auto"   (default) the faster of the two where measured: routed at decode-sized token counts, dense above.
           On the toy MoE (8 experts, top 2; `taskset -c 1 python -m launch.bench.moe --rounds 5`, cores shared
           with ~7 jobs) routed decode at batch 1 takes 2.18 vs 3.27 CPU ms per step (1.5x; wall 24 vs 39 ms,
           64 greedy tokens identical): it reads a quarter of the expert weights, and the tied 8192 x 256 head it
           shares with dense bounds the gain. The grouped prefill of 256 tokens is slower than dense (626 vs
           409 ms): XLA:CPU has no grouped-matmul kernel for ragged_dot.
           On an accelerator with one (GPU, TPU) "routed" is the candidate for prefill too: measure there.

Sharding: the expert weights [E, D, F] carry logical axes ("experts", "embed", "ffn"); under kvjax.sharding.RULES
"ffn" splits over 'model' and "experts" is replicated, i.e. every device holds a 1/m slice of EVERY expert's width
(tensor parallelism inside each expert), not whole experts. Why: the routed path gathers the chosen experts' weights
per token; with the width split that gather is local on every device, each device does 1/m of every chosen expert's
work whatever the routing (no load imbalance, no all-to-all), and the only communication is the all-reduce after
the down projection that a dense Qwen3 MLP already does. Qwen3-30B-A3B's width 768 splits 8 ways into 96 columns.
Expert parallelism (whole experts per device, an all-to-all dispatch) pays off when experts outnumber what one
device holds; map "experts" to 'model' in the rules to get that layout (the width then replicates).

The KV cache, the decoder and the cache map are Qwen3's unchanged: attention is dense.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.models import qwen3
from kvjax.models.config import ConfigError, Qwen3Config
from kvjax.models.decoder import rms_norm
from kvjax.models.family import Family, register
from kvjax.models.params import ParamSpec, spec, transpose
from kvjax.sharding import constrain

DISPATCH = ("auto", "routed", "dense")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config plus the MoE fields of an HF Qwen3MoeConfig; `intermediate_size` is the dense layers' width."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_dispatch: str = "auto"  # how sparse layers run (module docstring); not in the checkpoint

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts < 0 or self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ConfigError(f"num_experts ({self.num_experts}) must be >= 0, moe_intermediate_size "
                              f"({self.moe_intermediate_size}) and decoder_sparse_step ({self.decoder_sparse_step}) "
                              "positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got "
                              f"{self.num_experts_per_tok}")
        if self.moe_dispatch not in DISPATCH:
            raise ConfigError(f"moe_dispatch must be one of {DISPATCH}, got {self.moe_dispatch!r}")

    def is_sparse(self, i: int) -> bool:
        """Whether layer i has the MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def num_params(self) -> int:
        d, e = self.hidden_size, self.num_experts
        sparse = sum(self.is_sparse(i) for i in range(self.num_layers))
        moe_delta = e * 3 * d * self.moe_intermediate_size + d * e - 3 * d * self.intermediate_size
        return super().num_params() + sparse * moe_delta

    def active_params(self) -> int:
        """Parameters one token uses (the "A3B" of Qwen3-30B-A3B): the routed experts only."""
        d, k, e = self.hidden_size, self.num_experts_per_tok, self.num_experts
        sparse = sum(self.is_sparse(i) for i in range(self.num_layers))
        return self.num_params() - sparse * (e - k) * 3 * d * self.moe_intermediate_size

    def fingerprint(self) -> str:
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "Qwen3MoeConfig":
        archs = d.get("architectures") or []
        if d.get("model_type") != "qwen3_moe" or (archs and "Qwen3MoeForCausalLM" not in archs):
            raise ConfigError(f"{source}: not a Qwen3-MoE checkpoint (model_type 'qwen3_moe', architectures "
                              f"['Qwen3MoeForCausalLM']); got model_type={d.get('model_type')!r}, architectures={archs}")
        # the attention and the dense MLP are Qwen3's: its reader checks them (activation, biases, window, RoPE)
        base = Qwen3Config.from_hf_dict({**d, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, source)
        experts = d.get("num_experts", d.get("num_local_experts", 128))  # transformers 5 writes num_local_experts
        try:
            return cls(**dataclasses.asdict(base),
                       num_experts=int(experts),
                       num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                       moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
                       norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                       decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                       mlp_only_layers=tuple(int(i) for i in (d.get("mlp_only_layers") or ())))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: bad MoE field ({e})") from None

    def to_hf_dict(self) -> dict[str, Any]:
        out = super().to_hf_dict()
        out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=self.num_experts,
                   num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                   norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                   mlp_only_layers=list(self.mlp_only_layers), output_router_logits=False)
        return out


@struct.dataclass
class SparseLayerParams:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [D, Hq, hd]
    k: jax.Array  # [D, Hkv, hd]
    v: jax.Array  # [D, Hkv, hd]
    q_norm: jax.Array  # [hd]
    k_norm: jax.Array  # [hd]
    o: jax.Array  # [Hq, hd, D]
    mlp_norm: jax.Array  # [D]
    router: jax.Array  # [D, E]
    gate: jax.Array  # [E, D, F]
    up: jax.Array  # [E, D, F]
    down: jax.Array  # [E, F, D]


def layer_for(cfg: Qwen3MoeConfig, i: int) -> type:
    return SparseLayerParams if cfg.is_sparse(i) else qwen3.LayerParams


def param_specs(cfg: Qwen3MoeConfig) -> dict[str, ParamSpec]:
    """Qwen3's table with each sparse layer's dense MLP replaced by the router and the stacked experts (HF stores
    one [out, in] tensor per expert and projection: model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight)."""
    dense_width = dataclasses.replace(cfg, num_experts=0)  # every layer dense: Qwen3's table, keys and HF names
    specs = qwen3.param_specs(dense_width)
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        if not cfg.is_sparse(i):
            continue
        mlp, layer = f"model.layers.{i}.mlp.", f"layers.{i}."
        for name in ("gate", "up", "down"):
            del specs[layer + name]

        def experts(proj):
            return tuple(f"{mlp}experts.{j}.{proj}_proj.weight" for j in range(e))

        specs.update({
            layer + "router": spec((d, e), ("embed", "experts"), "normal", mlp + "gate.weight", **transpose()),
            layer + "gate": spec((e, d, f), ("experts", "embed", "ffn"), "normal", mlp + "experts.{e}.gate_proj.weight",
                                 hf_parts=experts("gate"), **transpose()),
            layer + "up": spec((e, d, f), ("experts", "embed", "ffn"), "normal", mlp + "experts.{e}.up_proj.weight",
                               hf_parts=experts("up"), **transpose()),
            layer + "down": spec((e, f, d), ("experts", "ffn", "embed"), "normal", mlp + "experts.{e}.down_proj.weight",
                                 hf_parts=experts("down"), **transpose()),
        })
    return specs


def route(lp: SparseLayerParams, cfg: Qwen3MoeConfig, h):
    """The router: (weights [N, k] in h's dtype, expert ids [N, k] int32) for tokens h [N, D], as transformers
    computes them (logits in h's dtype, softmax and top-k in float32, renormalised when norm_topk_prob)."""
    logits = jnp.einsum("nd,de->ne", h, lp.router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(h.dtype), ids.astype(jnp.int32)


def experts_dense(lp: SparseLayerParams, h, weights, ids):
    """Every expert on every token, unchosen ones weighted zero: [N, D]. Exact; E/k times the routed FLOPs."""
    dense_w = jnp.sum(jax.nn.one_hot(ids, lp.gate.shape[0], dtype=h.dtype) * weights[..., None], axis=1)  # [N, E]
    gate = jnp.einsum("nd,edf->nef", h, lp.gate)
    up = jnp.einsum("nd,edf->nef", h, lp.up)
    act = constrain(jax.nn.silu(gate) * up * dense_w[..., None], (None, None, "ffn"))
    return jnp.einsum("nef,efd->nd", act, lp.down)


def experts_gathered(lp: SparseLayerParams, h, weights, ids):
    """Each token gathers its k experts' weights: reads k of E experts per token ([N, k, D, F] gathered), so it wins
    when N * k is small next to E (decode)."""
    gate = jnp.einsum("nd,nkdf->nkf", h, lp.gate[ids])
    up = jnp.einsum("nd,nkdf->nkf", h, lp.up[ids])
    act = constrain(jax.nn.silu(gate) * up * weights[..., None], (None, None, "ffn"))
    return jnp.einsum("nkf,nkfd->nd", act, lp.down[ids])


def experts_grouped(lp: SparseLayerParams, h, weights, ids):
    """(token, expert) pairs sorted by expert and run as one grouped matmul per projection (jax.lax.ragged_dot):
    k/E of the dense FLOPs, each expert's weights read once (prefill)."""
    n, k = ids.shape
    e = lp.gate.shape[0]
    flat = ids.reshape(n * k)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    x = h[token]  # [N*k, D], grouped by expert
    gate = jax.lax.ragged_dot(x, lp.gate, sizes)
    up = jax.lax.ragged_dot(x, lp.up, sizes)
    act = jax.nn.silu(gate) * up * weights.reshape(n * k)[order][:, None]
    out = jax.lax.ragged_dot(act, lp.down, sizes)  # [N*k, D]
    return jnp.zeros_like(h).at[token].add(out)


def dispatch_for(cfg: Qwen3MoeConfig, tokens: int) -> str:
    """How a sparse layer runs `tokens` tokens (static): "dense", "gathered" (routed, few tokens) or "grouped"
    (routed, many). Gathered: decode-sized batches, whose gathered weights (tokens x k expert slices, copied) are at
    most half of all experts; at tokens x k == E the gathers were slower than dense on the toy MoE (batch 4: 80 vs
    52 ms/step)."""
    few = 2 * tokens * cfg.num_experts_per_tok <= cfg.num_experts
    if cfg.moe_dispatch == "dense" or (cfg.moe_dispatch == "auto" and not few):
        return "dense"
    return "gathered" if few else "grouped"


def moe(lp: SparseLayerParams, cfg: Qwen3MoeConfig, h):
    """The sparse MoE block on h [B, T, D] -> [B, T, D]."""
    b, t, d = h.shape
    flat = h.reshape(b * t, d)
    weights, ids = route(lp, cfg, flat)
    experts = {"dense": experts_dense, "gathered": experts_gathered, "grouped": experts_grouped}
    return experts[dispatch_for(cfg, b * t)](lp, flat, weights, ids).reshape(b, t, d)


def finish(lp, cfg: Qwen3MoeConfig, x, attn):
    """Output projection, then the MLP of this layer (dense: Qwen3's; sparse: the MoE block), with residuals."""
    if isinstance(lp, qwen3.LayerParams):
        return qwen3.finish(lp, cfg, x, attn)
    x = x + jnp.einsum("bthk,hkd->btd", attn, lp.o)
    x = x + moe(lp, cfg, rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps))
    return constrain(x, ("batch", None, None))


QWEN3_MOE = register(Family(name="qwen3_moe", config=Qwen3MoeConfig, model_types=("qwen3_moe",),
                            layer=SparseLayerParams, param_specs=param_specs, qkv=qwen3.qkv, finish=finish,
                            layer_for=layer_for))
