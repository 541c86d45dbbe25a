"""Why does the mapped cache not retrieve the needle? Probes on the shipped retrieval set.

    python -m experiments.retrieval_diag --map RUN/map --part arms        # which caches make the target retrieve
    python -m experiments.retrieval_diag --map RUN/map --part layers      # which target layer is the reader
    python -m experiments.retrieval_diag --map RUN/map --part attention   # who attends to the needle (both models)
    python -m experiments.retrieval_diag --map RUN/map --part optimise    # can ANY needle-span cache make it work
    python -m experiments.retrieval_diag --part copies --pool-prefix 256 --pool-cont 64   # copies in training
    python -m experiments.retrieval_diag --map RUN/map --extra new=DIR --part mc --arms new   # MC, paired vs map

Items: the first --n of checkpoints/toy/eval/retrieval_{length}.jsonl (all exactly `length` tokens, so they batch).
Every arm is a recipe for the target's cache of prompt[:-1]; the target then reads [last prompt token, answer[:-1]]
teacher-forced. Greedy exact match equals "every teacher-forced argmax is the answer token" (greedy follows the
answer until its first wrong argmax), so one pass gives exact match, per-token accuracy and the answer log-prob.

Recipes: `source` (the source answers from its own cache: the ceiling), `target` (native), `map` / `ridge` (the
--map artifact with / without its residual), `direct:a,b,c` (target layer i reads the source's layer a/b/c cache
unchanged; both models here have equal KV shapes and RoPE; direct:0,3,5 is the oracle pairing the pruned target
was cut from), `mix:BASE:j=OTHER` (BASE with target layer j's K/V taken from OTHER), `top1` (the map, then the
target recomputes its top layer over it: kvjax.builders.partial, mode top), NAME for a map given with
--extra NAME=DIR, and `MAP@j=s` (MAP with target layer j's K/V copied from source layer s, which must be in j's
pairing; `s+k` / `s+v` copy only the keys / values). `--target-cut 0,3,5` answers with the source's own layers
instead of the fine-tuned target (same shapes), to tell the cut from the fine-tuning. Any needle option of
launch.toy.evalsets (--needle, --query, --answer, --depth, --value-digits, ...) builds fresh items in that format
instead of the shipped set (as experiments.needle_probe does), e.g. a separator the training never showed.

Parts: `attention` reports, per layer and head, the attention mass at each answer position on the needle token that
answer position must copy (the induction target), for the source and for the target under a few recipes, and the
source's previous-token mass on the needle; `optimise` frees the target's K/V on the needle's tokens only (every
layer, or one) and minimises the answer's cross-entropy per item (Adam): if the target then retrieves, its queries
can find a needle and the failure is in what the map writes there; `copies` counts the continuation tokens of the
residual's training windows (kvjax.windows.sample, as the teacher pool draws them) that an induction copy predicts
(the 3 tokens before them and the token itself occur earlier in the window), by distance; `mc` scores map recipes
on the shipped HellaSwag / PIQA sets (--mc-items per set) and source-teacher KL on 64 held-out windows, with paired
bootstrap intervals against `map`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kvjax
from kvjax.builders.base import bucket
from kvjax.builders import NativePrefill
from kvjax.builders.partial import recompute_jit
from kvjax.cache import KVCache
from kvjax.eval.needle_retrieval import load_retrieval
from kvjax.mapper.kvmap import KVMap, apply_map, ridge_only
from kvjax.models.decoder import NEG_INF, embed, finish, head_angles, qkv, rms_norm, unembed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- items ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Batch:
    prompts: np.ndarray  # int32 [N, T]
    answers: np.ndarray  # int32 [N, A]
    value_pos: np.ndarray  # int32 [N]: where answer token 0 sits inside the needle (the copy target of position 0)


def probe_items(needle_args: list[str], tokenizer, length: int, n: int) -> list:
    """Items in another needle format (launch.toy.evalsets' options, e.g. --needle '{key}: {value}\\n' --query
    '{key}:'), built fresh from held-out files with needle_probe's seed (123), not the shipped set's."""
    from pathlib import Path

    from kvjax.eval.multiple_choice import encode
    from kvjax.eval.needle_retrieval import RetrievalItem
    from launch.toy import evalsets
    fmt = evalsets.parse_args([*needle_args, "--n-retrieval", str(n)])
    docs = evalsets.heldout_docs(Path(REPO) / "checkpoints/toy/data/manifest.json", tokenizer, fmt.haystack)
    rows = evalsets.build_retrieval(docs, length, fmt, tokenizer, np.random.default_rng(123))
    return [RetrievalItem(encode(tokenizer, r["prompt"]), r["answer_ids"], r["length"], r["needle_position"],
                          r["prompt"], r["answer"]) for r in rows]


def load_items(path: str, tokenizer, n: int, items=None) -> Batch:
    items = items if items is not None else load_retrieval(path, tokenizer, limit=n)
    if len({it.length for it in items}) != 1 or len({len(it.answer_ids) for it in items}) != 1:
        raise SystemExit(f"{path}: items of different lengths; this probe batches equal-length items")
    prompts = np.asarray([it.prompt_ids for it in items], np.int32)
    answers = np.asarray([it.answer_ids for it in items], np.int32)
    value_pos = []
    for it in items:  # the answer's tokens inside the needle line (it is the only occurrence: keys/values are unique)
        a, p = list(it.answer_ids), list(it.prompt_ids)
        hits = [s for s in range(it.needle_position, min(len(p) - len(a), it.needle_position + 64))
                if p[s : s + len(a)] == a]
        if not hits:
            raise SystemExit(f"{path}: the answer {it.answer!r} is not inside its needle; the probe needs it there")
        value_pos.append(hits[0])
    return Batch(prompts, answers, np.asarray(value_pos, np.int32))


# ---- cache recipes ----------------------------------------------------------------------------------------------

def reader_direct(kvmap: KVMap, layer: int, source_layer: int) -> KVMap:
    """`kvmap` with target layer `layer`'s keys and values replaced by the source layer `source_layer`'s, unchanged
    (an identity on that layer's slot of the paired features; its residual off). Only where that source layer is in
    the layer's pairing and the KV shapes agree: the map's artifact format stays the same."""
    pairing = kvmap.spec.pairing[layer]
    if source_layer not in pairing or kvmap.spec.source_kv != kvmap.spec.target_kv:
        raise SystemExit(f"target layer {layer} reads source layers {pairing} (KV {kvmap.spec.source_kv} -> "
                         f"{kvmap.spec.target_kv}); an identity on source layer {source_layer} needs it among them "
                         "and equal KV shapes")
    f = kvmap.spec.target_kv[0] * kvmap.spec.target_kv[1]
    slot = pairing.index(source_layer)

    def ident(m):
        w_in = np.zeros(m.w_in.shape, np.float32)
        w_in[slot * f : (slot + 1) * f, :f] = np.eye(f)
        w_out = np.zeros(m.w_out.shape, np.float32)
        w_out[:f] = np.eye(f)
        return m.replace(mu=jnp.zeros_like(m.mu), w_in=jnp.asarray(w_in), w_out=jnp.asarray(w_out),
                         bias=jnp.zeros_like(m.bias), up=jnp.zeros_like(m.up))

    keys, values = list(kvmap.keys), list(kvmap.values)
    keys[layer], values[layer] = ident(keys[layer]), ident(values[layer])
    return kvmap.replace(keys=tuple(keys), values=tuple(values))


def map_recipe(name: str, maps: dict) -> KVMap | None:
    """A map by recipe name: a loaded one, or BASE@j=s (BASE with target layer j copied from source layer s, with
    `+k` (keys only) / `+v` (values only) suffixes after s to keep the other from BASE)."""
    if name in maps:
        return maps[name]
    if "@" not in name:
        return None
    base, swaps = name.split("@", 1)
    kvmap = maps.get(base)
    if kvmap is None:
        return None
    for swap in swaps.split("@"):
        j, s = swap.split("=")
        only = s[-2:] if s[-2:] in ("+k", "+v") else ""
        new = reader_direct(kvmap, int(j), int(s.removesuffix(only)))
        if only == "+k":
            new = new.replace(values=kvmap.values)
        elif only == "+v":
            new = new.replace(keys=kvmap.keys)
        kvmap = new
    return kvmap


class Recipes:
    """Target caches of prompt[:-1] for a batch, by recipe name (see the module docstring)."""

    def __init__(self, source, target, maps: dict, capacity: int):
        self.source, self.target, self.maps, self.capacity = source, target, maps, capacity

    def source_cache(self, prompts) -> KVCache:
        t = prompts.shape[1] - 1
        return NativePrefill(self.source)(prompts[:, :-1], np.full((len(prompts),), t, np.int32),
                                          capacity=self.capacity)

    def __call__(self, name: str, prompts) -> KVCache:
        t = prompts.shape[1] - 1
        if name == "source":
            return self.source_cache(prompts)
        if name == "target":
            return NativePrefill(self.target)(prompts[:, :-1], np.full((len(prompts),), t, np.int32),
                                              capacity=self.capacity)
        if name.startswith("direct:"):
            layers = [int(s) for s in name.split(":", 1)[1].split(",")]
            src = self.source_cache(prompts)
            return KVCache(keys=tuple(src.keys[i] for i in layers), values=tuple(src.values[i] for i in layers),
                           lengths=src.lengths)
        if name.startswith("mix:"):
            _, base, swap = name.split(":", 2)  # mix:BASE:j=OTHER (OTHER may itself hold ':' but not '=')
            j, other = swap.split("=", 1)
            a, b = self(base.replace(";", ":"), prompts), self(other.replace(";", ":"), prompts)
            js = [int(x) for x in j.split(",")]
            return a.replace(keys=tuple(b.keys[i] if i in js else x for i, x in enumerate(a.keys)),
                             values=tuple(b.values[i] if i in js else x for i, x in enumerate(a.values)))
        if name == "top1" or name.startswith("top1:"):
            base = name.split(":", 1)[1] if ":" in name else "map"
            cfg, params = self.target
            mapped = self(base, prompts)
            return recompute_jit(params, cfg, jnp.asarray(prompts[:, :-1]), mapped.lengths, mapped,
                                 (cfg.num_layers - 1,))
        kvmap = map_recipe(name, self.maps)
        if kvmap is not None:
            return apply_map(kvmap, self.source_cache(prompts), capacity=self.capacity, length=t)
        raise SystemExit(f"unknown recipe {name!r}: source, target, map, ridge, direct:a,b,c, mix:BASE:j=OTHER, top1, "
                         "or a name given with --extra NAME=MAPDIR")


# ---- scoring ----------------------------------------------------------------------------------------------------

def attn_forward(params, cfg, tokens, cache: KVCache, want_probs: bool = False):
    """`forward` for tokens [B, S] after a cache holding `cache.lengths` positions (all rows equal), written out so
    the attention probabilities can be returned: (logits [B, S, V], probs per layer [B, Hq, S, C] or None)."""
    b, s = tokens.shape
    start = cache.lengths[:, None]
    positions = start + jnp.arange(s, dtype=jnp.int32)[None]
    cos, sin = head_angles(cfg, positions)
    x = embed(params, tokens)
    hkv, cap = cache.k.shape[2], cache.k.shape[3]
    g = cfg.num_heads // hkv
    key_pos = jnp.arange(cap)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, S, C]
    rows = jnp.arange(b)[:, None]
    probs_out = []
    k_buf, v_buf = cache.k, cache.v
    for i, lp in enumerate(params.layers):
        q, k, v = qkv(lp, cfg, x, cos, sin)  # [B, S, H, hd]
        k_buf = k_buf.at[i, rows, :, positions].set(k.astype(k_buf.dtype))
        v_buf = v_buf.at[i, rows, :, positions].set(v.astype(v_buf.dtype))
        kk = jnp.repeat(k_buf[i], g, axis=1)  # [B, Hq, C, hd]: query head h reads kv head h // g
        vv = jnp.repeat(v_buf[i], g, axis=1)
        scores = jnp.einsum("bshd,bhcd->bhsc", q, kk) * (q.shape[-1] ** -0.5)
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, NEG_INF), axis=-1)
        if want_probs:
            probs_out.append(probs)
        attn = jnp.einsum("bhsc,bhcd->bshd", probs, vv)
        x = finish(lp, cfg, x, attn)
    logits = unembed(params, rms_norm(x, params.final_norm, cfg.rms_norm_eps))
    return logits, (probs_out if want_probs else None)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _score(params, cfg, cache, prompts_last, answers):
    tokens = jnp.concatenate([prompts_last[:, None], answers[:, :-1]], axis=1)
    logits, _ = attn_forward(params, cfg, tokens, cache)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    tok_logp = jnp.take_along_axis(logp, answers[..., None], -1)[..., 0]
    return jnp.argmax(logits, -1) == answers, tok_logp


def score(model, cache: KVCache, batch_prompts, batch_answers):
    """(exact [B], per-token correct [B, A], answer log-prob [B])."""
    cfg, params = model
    ok, lp = _score(params, cfg, cache, jnp.asarray(batch_prompts[:, -1]), jnp.asarray(batch_answers))
    ok, lp = np.asarray(ok), np.asarray(lp)
    return ok.all(1), ok, lp.sum(1)


def answering_model(name: str, recipes: Recipes):
    return recipes.source if name == "source" else recipes.target


def run_arms(names, recipes: Recipes, items: Batch, bs: int) -> dict:
    out = {}
    for name in names:
        t0 = time.time()
        ex, tok, lp = [], [], []
        for i in range(0, len(items.prompts), bs):
            p, a = items.prompts[i : i + bs], items.answers[i : i + bs]
            e, o, l = score(answering_model(name, recipes), recipes(name, p), p, a)
            ex.append(e), tok.append(o), lp.append(l)
        ex, tok, lp = np.concatenate(ex), np.concatenate(tok), np.concatenate(lp)
        out[name] = ex
        print(f"| {name} | {int(ex.sum())}/{len(ex)} | {tok[:, 1:].mean():.1%} | {tok[:, 1].mean():.1%} "
              f"| {lp.mean():.2f} | {time.time() - t0:.0f} s |", flush=True)
    return out


ARMS_HEADER = ("| cache | exact | digit tokens correct | first digit | answer log-prob | time |\n"
               "|---|---:|---:|---:|---:|---:|")


# ---- attention --------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg",))
def _copy_mass(params, cfg, cache, prompts_last, answers, value_pos):
    """Per layer: attention mass [B, Hq, A] of answer position j on needle token value_pos + j (the token to copy)."""
    tokens = jnp.concatenate([prompts_last[:, None], answers[:, :-1]], axis=1)
    _, probs = attn_forward(params, cfg, tokens, cache, want_probs=True)
    a = answers.shape[1]
    idx = value_pos[:, None] + jnp.arange(a)[None]  # [B, A]
    return jnp.stack([jnp.take_along_axis(p, jnp.broadcast_to(idx[:, None, :, None], p.shape[:3] + (1,)),
                                          -1)[..., 0] for p in probs])  # [L, B, Hq, A]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prev_token_mass(params, cfg, prompts, value_pos):
    """The source reading the prompt from scratch: per layer, head, the attention of needle tokens
    value_pos-3 .. value_pos+A on their previous token: [L, B, Hq, 9] (needle positions)."""
    empty = kvjax.init_cache(cfg, prompts.shape[0], prompts.shape[1], params.embed.dtype)
    _, probs = attn_forward(params, cfg, prompts, empty, want_probs=True)
    pos = value_pos[:, None] + jnp.arange(-3, 6)[None]  # [B, 9]
    bi, hi = jnp.arange(prompts.shape[0])[:, None, None], jnp.arange(cfg.num_heads)[None, :, None]
    out = [p[bi, hi, pos[:, None, :], (pos - 1)[:, None, :]] for p in probs]  # p [B, H, S, C] -> [B, H, 9]
    return jnp.stack(out)


def run_attention(names, recipes: Recipes, items: Batch, bs: int) -> None:
    print("\nCopy attention: per layer, the mean over items and answer positions 1.. (the digits) of each head's mass "
          "on the needle token it must copy (uniform over the context would be ~0.001)\n")
    print("| cache (answering model) | " + " | ".join(f"layer {i}" for i in range(6)) + " |")
    print("|---|" + "---|" * 6)
    for name in names:
        cfg, params = answering_model(name, recipes)
        masses = []
        for i in range(0, len(items.prompts), bs):
            p, a, v = items.prompts[i : i + bs], items.answers[i : i + bs], items.value_pos[i : i + bs]
            masses.append(np.asarray(_copy_mass(params, cfg, recipes(name, p), jnp.asarray(p[:, -1]), jnp.asarray(a),
                                                jnp.asarray(v))))
        m = np.concatenate(masses, 1)[..., 1:].mean(axis=(1, 3))  # [L, Hq]
        cells = [" ".join(f"{x:.2f}" for x in row) for row in m]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    cfg, params = recipes.source
    prev = []
    for i in range(0, len(items.prompts), bs):
        p, v = items.prompts[i : i + bs], items.value_pos[i : i + bs]
        prev.append(np.asarray(_prev_token_mass(params, cfg, jnp.asarray(p), jnp.asarray(v))))
    m = np.concatenate(prev, 1).mean(axis=(1, 3))
    print("\nSource previous-token attention on the needle's tokens (key tail, ' =', value): per layer, per head\n")
    print("| " + " | ".join(f"layer {i}" for i in range(len(m))) + " |")
    print("|" + "---|" * len(m))
    print("| " + " | ".join(" ".join(f"{x:.2f}" for x in row) for row in m) + " |", flush=True)


# ---- optimise the needle's cache entries -------------------------------------------------------------------------

def run_optimise(base: str, recipes: Recipes, items: Batch, bs: int, steps: int, lr: float, layers_opts, kinds,
                 width: int) -> None:
    cfg, params = recipes.target
    a_len = items.answers.shape[1]
    print(f"\nOptimise the target's cache entries on the needle (positions value_pos-{width}..value_pos+{a_len}) from "
          f"the `{base}` cache: Adam lr {lr}, {steps} steps, answer cross-entropy; exact match before -> after\n")
    print("| freed | layers | exact before | exact after | answer log-prob before -> after |")
    print("|---|---|---:|---:|---|")
    opt = optax.adam(lr)
    step = _opt_step(opt, cfg)  # one compile: the masks are arguments
    for kind in kinds:
        for layers in layers_opts:
            before, after, lp0, lp1 = [], [], [], []
            for i in range(0, len(items.prompts), bs):
                p, a, vpos = items.prompts[i : i + bs], items.answers[i : i + bs], items.value_pos[i : i + bs]
                cache = recipes(base, p)
                span = np.zeros((len(p), cache.capacity), np.float32)
                for r, v0 in enumerate(vpos):
                    span[r, v0 - width : v0 + a_len] = 1.0
                lmask = np.zeros((cfg.num_layers,), np.float32)
                lmask[list(layers)] = 1.0
                m = jnp.asarray(lmask)[:, None, None, None, None] * jnp.asarray(span)[None, :, None, :, None]
                mk, mv = (m if "k" in kind else 0 * m), (m if "v" in kind else 0 * m)
                delta = (jnp.zeros_like(cache.k), jnp.zeros_like(cache.v))
                state = opt.init(delta)
                last, ans = jnp.asarray(p[:, -1]), jnp.asarray(a)
                e0, _, l0 = score(recipes.target, cache, p, a)
                for _ in range(steps):
                    delta, state, _ = step(params, delta, state, cache, mk, mv, last, ans)
                opt_cache = cache.with_stacked(cache.k + mk * delta[0], cache.v + mv * delta[1])
                e1, _, l1 = score(recipes.target, opt_cache, p, a)
                before.append(e0), after.append(e1), lp0.append(l0), lp1.append(l1)
            b, af = np.concatenate(before), np.concatenate(after)
            print(f"| {kind} | {','.join(map(str, layers))} | {int(b.sum())}/{len(b)} | {int(af.sum())}/{len(af)} "
                  f"| {np.concatenate(lp0).mean():.2f} -> {np.concatenate(lp1).mean():.2f} |", flush=True)


def _opt_step(opt, cfg):
    @jax.jit
    def step(params, delta, state, cache, mk, mv, last, answers):
        def loss(d):
            c = cache.with_stacked(cache.k + mk * d[0], cache.v + mv * d[1])
            tokens = jnp.concatenate([last[:, None], answers[:, :-1]], axis=1)
            logits, _ = attn_forward(params, cfg, tokens, c)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            return -jnp.take_along_axis(logp, answers[..., None], -1).mean()
        value, grads = jax.value_and_grad(loss)(delta)
        updates, state = opt.update(grads, state, delta)
        return optax.apply_updates(delta, updates), state, value
    return step


# ---- copies in the residual's training windows -------------------------------------------------------------------

def run_copies(train_tokens: str, n: int, prefix: int, cont: int, seed: int, ngram: int) -> None:
    from kvjax.windows import sample
    tokens = np.load(train_tokens, mmap_mode="r")
    windows = sample(tokens, n, prefix + cont, seed=seed + 7919)  # the teacher pool's draw (build_pool)
    dists = []
    total = 0
    for w in windows:
        w = np.asarray(w).tolist()
        seen: dict[tuple, int] = {}
        for t in range(ngram, len(w)):
            key = tuple(w[t - ngram : t + 1])
            if t >= prefix and key in seen:
                dists.append(t - seen[key])
            if t >= prefix:
                total += 1
            seen[key] = t
    d = np.asarray(dists)
    print(f"\nResidual training windows ({n} of {prefix} + {cont} tokens, {train_tokens}): continuation tokens that an "
          f"induction copy predicts (the {ngram} tokens before and the token itself occurred earlier; nearest "
          f"occurrence):\n")
    print("| distance | tokens | share of continuation tokens |")
    print("|---|---:|---:|")
    for lo, hi in ((1, 64), (64, 128), (128, 256), (256, 512), (512, 10**9)):
        c = int(((d >= lo) & (d < hi)).sum())
        print(f"| {lo}-{hi if hi < 10**9 else 'inf'} | {c} | {c / max(total, 1):.2%} |")
    print(f"| all | {len(d)} | {len(d) / max(total, 1):.2%} |  (max distance {d.max() if len(d) else 0}; "
          f"the needle sits ~{int(0.85 * 1024)} tokens back)")


# ---- multiple choice of map recipes ------------------------------------------------------------------------------

def run_mc(names, source, target, maps: dict, limit: int, bs: int, baseline: str) -> None:
    from kvjax.builders import Mapped
    from kvjax.builders.mapped import SourcePrefill
    from kvjax.eval.arms import Arm, score_mc_arms
    from kvjax.eval.multiple_choice import load_mc
    from kvjax.eval.stats import paired_bootstrap_ci
    tok = kvjax.load_tokenizer(os.path.join(REPO, "checkpoints/toy/source"))
    shared = SourcePrefill(source)
    arms = []
    for name in dict.fromkeys([baseline, *names]):
        kvmap = map_recipe(name, maps)
        if kvmap is None:
            raise SystemExit(f"--part mc scores maps; {name!r} is not one (map, ridge, an --extra name, BASE@j=s)")
        b = functools.partial(Mapped(source, target, kvmap, name=name, shared=shared), bucketed=True)
        arms.append(Arm(name, target, None, b))
    print(f"\nMultiple choice ({limit} items per set), paired difference to `{baseline}` (95% bootstrap)\n")
    print("| map | HellaSwag | vs baseline | PIQA | vs baseline |\n|---|---:|---|---:|---|")
    res = {}
    for schema in ("hellaswag", "piqa"):
        items = load_mc(os.path.join(REPO, f"checkpoints/toy/eval/{schema}.jsonl"), schema, limit=limit)
        res[schema] = score_mc_arms(items, tok, arms, batch_size=bs, progress=False)
    for a in arms:
        cells = []
        for schema in ("hellaswag", "piqa"):
            r, b = res[schema][a.name].correct, res[schema][baseline].correct
            ci = paired_bootstrap_ci(r, b)
            cells += [f"{100 * r.mean():.1f}", f"{100 * ci.mean:+.1f} [{100 * ci.lo:+.1f}, {100 * ci.hi:+.1f}]"]
        print(f"| {a.name} | " + " | ".join(cells) + " |", flush=True)


def run_kl(names, source, target, maps: dict, windows: int, baseline: str) -> None:
    """Source-teacher KL of each map on the run's held-out windows (prefix 256, continuation 64: the job's `kl`
    evaluation), paired against `baseline`."""
    from kvjax.eval.stats import paired_bootstrap_ci
    from kvjax.fitting.residual import evaluate_kl
    w = np.load(os.path.join(REPO, "checkpoints/toy/eval/heldout_windows.npy"))[:windows, : 256 + 64].astype(np.int32)
    base = evaluate_kl(map_recipe(baseline, maps), source, target, w, 256)
    print(f"\nSource-teacher KL, {windows} held-out windows (256 + 64), paired difference to `{baseline}`\n")
    print(f"| map | KL | vs baseline |\n|---|---:|---|\n| {baseline} | {base.mean():.4f} | |")
    for name in names:
        got = evaluate_kl(map_recipe(name, maps), source, target, w, 256)
        ci = paired_bootstrap_ci(got, base)
        print(f"| {name} | {got.mean():.4f} | {ci.mean:+.4f} [{ci.lo:+.4f}, {ci.hi:+.4f}] |", flush=True)


# ---- main -------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("arms", "layers", "attention", "optimise", "copies", "mc"), default="arms")
    p.add_argument("--source", default=os.path.join(REPO, "checkpoints/toy/source"))
    p.add_argument("--target", default=os.path.join(REPO, "checkpoints/toy/pruned"))
    p.add_argument("--map", default="runs/toy_pruned_quick/map", help="a map artifact of the pair (a run's map/)")
    p.add_argument("--extra", nargs="*", default=[], metavar="NAME=MAPDIR", help="more maps, usable as recipes")
    p.add_argument("--arms", nargs="*", help="recipes to score (default per part)")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--n", type=int, default=50, help="items (the first N of the shipped set)")
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=150, help="optimise: Adam steps")
    p.add_argument("--lr", type=float, default=0.05, help="optimise: Adam learning rate")
    p.add_argument("--width", type=int, default=6, help="optimise: needle tokens freed before the value")
    p.add_argument("--train-tokens", default="",
                   help="copies: training tokens (default: RUN/data/train_tokens.npy of --map's run)")
    p.add_argument("--pool-windows", type=int, default=1536)
    p.add_argument("--pool-prefix", type=int, default=256)
    p.add_argument("--pool-cont", type=int, default=64)
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--target-cut", default="", metavar="a,b,c",
                   help="answer with the source's own layers a,b,c (no fine-tuning) in place of --target's weights")
    p.add_argument("--mc-items", type=int, default=300, help="mc: items per set")
    args, needle_args = p.parse_known_args(argv)
    if needle_args and not all(a.startswith("--") or i and needle_args[i - 1].startswith("--")
                               for i, a in enumerate(needle_args)):
        p.error(f"unrecognised arguments {needle_args}")
    if args.part == "copies":
        args.train_tokens = args.train_tokens or os.path.join(os.path.dirname(os.path.abspath(args.map)), "data",
                                                              "train_tokens.npy")
        if not os.path.isfile(args.train_tokens):
            raise SystemExit(f"--train-tokens {args.train_tokens}: no such file (a run's data/train_tokens.npy)")
        return run_copies(args.train_tokens, args.pool_windows, args.pool_prefix, args.pool_cont, 0, args.ngram)
    for path in [args.map] + [e.split("=", 1)[-1] for e in args.extra]:
        if not os.path.isdir(path):
            raise SystemExit(f"no map artifact at {path}: pass --map RUN/map (a kvjax.launch run's map directory)")
    source, target = kvjax.load_hf(args.source), kvjax.load_hf(args.target)
    if args.target_cut:  # the pruned stack before its fine-tuning: is the reader's failure the cut or the tuning?
        cut = [int(i) for i in args.target_cut.split(",")]
        if len(cut) != target[0].num_layers:
            raise SystemExit(f"--target-cut names {len(cut)} layers; the target has {target[0].num_layers}")
        sp = source[1]
        target = (target[0], dataclasses.replace(sp, layers=tuple(sp.layers[i] for i in cut)))
    kvmap = kvjax.load_map(args.map, source[0], target[0])
    maps = {"map": kvmap, "ridge": ridge_only(kvmap)}
    for e in args.extra:
        name, path = e.split("=", 1)
        maps[name] = kvjax.load_map(path, source[0], target[0])
    tok = kvjax.load_tokenizer(args.target)
    extra = probe_items(needle_args, tok, args.length, args.n) if needle_args else None  # another needle format
    items = load_items(os.path.join(REPO, f"checkpoints/toy/eval/retrieval_{args.length}.jsonl"), tok, args.n, extra)
    capacity = bucket(args.length + items.answers.shape[1])
    recipes = Recipes(source, target, maps, capacity)
    what = "format " + " ".join(needle_args) if needle_args else "shipped set"
    print(f"{args.n} items at {args.length} tokens ({what}); map {args.map}")
    if args.part == "arms":
        print(ARMS_HEADER)
        run_arms(args.arms or ["source", "target", "map", "ridge", "direct:0,3,5", "top1"], recipes, items,
                 args.batch)
    elif args.part == "layers":
        n = target[0].num_layers
        arms = args.arms or ([f"mix:map:{j}=direct;0,3,5" for j in range(n)]
                             + [f"mix:direct;0,3,5:{j}=map" for j in range(n)]
                             + [f"mix:map:{j}=target" for j in range(n)])
        print(ARMS_HEADER)
        run_arms(arms, recipes, items, args.batch)
    elif args.part == "mc":
        run_mc(args.arms or ["map@1=3"], source, target, maps, args.mc_items, 8, "map")
        run_kl(args.arms or ["map@1=3"], source, target, maps, 64, "map")
    elif args.part == "attention":
        run_attention(args.arms or ["source", "target", "map", "direct:0,3,5"], recipes, items, args.batch)
    else:
        n = target[0].num_layers
        run_optimise((args.arms or ["map"])[0], recipes, items, args.batch, args.steps, args.lr,
                     [tuple(range(n))] + [(j,) for j in range(n)], ("kv", "k"), args.width)


if __name__ == "__main__":
    main()
