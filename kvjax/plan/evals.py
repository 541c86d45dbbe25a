"""The evaluations' programs: one entry per evaluation of the job's registry (kvjax.eval.suite), each listing the
library programs its `run` calls, at the shapes its settings give.

Shapes that depend on the data (how long a multiple-choice context is, how many tokens an answer has) are taken at
the bounds below (`MC_CONTEXT`, `MC_OPTION`, `ANSWER`): the token axis is bucketed to multiples of 64 by the scorers
(kvjax.builders.base.bucket), so these are the largest programs the sets' items need. An evaluation of the registry
without an entry here stops the plan (`PlanError` naming it): a plan that silently left a stage out would say it fits
when it may not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.builders.base import bucket
from kvjax.generation.prompts import aligned
from kvjax.plan import costs, shapes
from kvjax.plan.hardware import PlanError
from kvjax.plan.program import Program
from kvjax.plan.programs import Builder

MC_CONTEXT = 256  # tokens of a multiple-choice context, bucketed (HellaSwag's and PIQA's fit in 256 with Qwen3's
MC_OPTION = 64  # tokenizer) and of one option
MC_OPTIONS = {"hellaswag": 4, "piqa": 2}
ANSWER = 16  # tokens of a retrieval answer, bucketed to 64 with the prompt's last token by the scorer


def programs(name: str, b: Builder, cfg, maps: dict, final: str) -> list[Program]:
    if name not in PLANS:
        raise PlanError(f"the plan has no entry for evaluation {name!r} (kvjax/plan/evals.py); disable it for the plan "
                        f"(--config.eval.{name}.enabled=false) or add its programs there")
    return PLANS[name](b, getattr(cfg.eval, name), cfg, _Maps(b, maps), final)


class _Maps:
    """The fitted maps by arm name (abstract, on the mesh), and the direct-injection map."""

    def __init__(self, b: Builder, fitted: dict):
        self.b, self.fitted = b, fitted

    def __call__(self, name: str):
        if name in ("direct", "raw"):
            from kvjax.mapper.injection import injection_map
            m = jax.eval_shape(lambda: injection_map(self.b.source.cfg, self.b.target.cfg))
            from kvjax.mapper.kvmap import kvmap_shardings
            return shapes.abstract(m, kvmap_shardings(m, self.b.mesh))
        return self.fitted.get(name, self.fitted.get("residual", next(iter(self.fitted.values()))))


def arm_programs(b: Builder, arm: str, maps: _Maps, final: str, cfg, rows: int, length: int,
                 capacity: int) -> list[Program]:
    """The programs an arm's cache builder (kvjax.eval.arms.TABLE) runs for rows x length prompt tokens into a cache
    of `capacity`."""
    if arm == "target":
        return [b.prefill("target", rows, length, capacity)]
    if arm == "source":
        return [b.prefill("source", rows, length, capacity)]
    m = maps(final if arm in ("partial", "tail", "partial_tail") else arm)
    out = [b.prefill("source", rows, length, capacity), b.apply_map(m, rows, length, capacity, name=f"{arm} map")]
    settings = cfg.arms
    if arm in ("partial", "partial_tail") and settings.partial_k:
        from kvjax.builders.partial import recompute_layers
        layers = recompute_layers(b.target.cfg.num_layers, settings.partial_k, settings.partial_mode)
        if len(layers) == b.target.cfg.num_layers:
            out = [b.prefill("target", rows, length, capacity)]
        else:
            out.append(b.recompute(layers, rows, length, capacity))
    if arm in ("tail", "partial_tail") and settings.tail_tokens:
        out.append(b.prefill("target", rows, settings.tail_tokens, capacity, cache=True, context=length,
                             what="native tail"))
    return out


def _arms(ec, cfg) -> tuple[str, ...]:
    from kvjax.eval.arms import available
    from kvjax.run.layout import fitted_maps
    return available(ec.arms, fitted_maps(cfg))


def distances(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """map_distances: the target's and the source's prefill of each batch, the target's own queries and attention
    outputs (attention_fidelity.native_attention), each map (raw injection and the fitted ones) and the target's
    attention over each mapped cache (attention_fidelity.cache_attention). The native cache, the shared source
    cache and the native queries and outputs stay alive while the maps run."""
    from kvjax.eval import attention_fidelity
    from kvjax.run.layout import fitted_maps
    rows, t = ec.batch_size, ec.window_len
    tcfg = b.target.cfg
    out = [b.prefill("target", rows, t), b.prefill("source", rows, t)]
    tokens = b.tokens(rows, t)
    flops = b.fwd("target", rows, t, (t + 1) / 2, 0)
    out.append(b.program(f"target queries and attention {rows} x {t}", attention_fidelity.native_attention,
                         (b.target.params, tcfg, tokens), {}, flops, b.wbytes("target", rows * t, False),
                         ("target",)))
    q = shapes.replicated((tcfg.num_layers, rows, t, tcfg.num_heads, tcfg.head_dim), b.dtype, b.mesh)
    kv = shapes.replicated((tcfg.num_layers, rows, tcfg.num_kv_heads, t, tcfg.head_dim), b.dtype, b.mesh)
    native, source = b.cache("target", rows, t), b.cache("source", rows, t)
    for name in ("raw", *fitted_maps(cfg)):
        out.append(b.keeping(b.apply_map(maps(name), rows, t, t, name=f"{name} map"), native, source, q, q))
    attn = 4.0 * rows * t * (t + 1) / 2 * tcfg.num_heads * tcfg.head_dim * tcfg.num_layers
    out.append(b.keeping(b.program(f"target attention over a mapped cache {rows} x {t}",
                                   attention_fidelity.cache_attention, (q, kv, kv), {}, attn,
                                   shapes.nbytes(q) * 2 + shapes.nbytes(kv) * 2, ()), native, source, native, q))
    return out


def _agreement(b: Builder, rows: int, prefix: int, cont: int, builders: list[list[Program]], what: str
               ) -> list[Program]:
    """agreement_table: the references (both models' no-cache forward over the window), each builder's cache of
    the prefix, the target's logits from it over the continuation (agreement._student) and the comparison."""
    from kvjax.eval import token_agreement as agreement
    (scfg, sparams), (tcfg, tparams) = b.source, b.target
    w = prefix + cont
    tokens = b.tokens(rows, w)
    flops = (b.fwd("source", rows, w - 1, w / 2, w - 1) + b.fwd("target", rows, w - 1, w / 2,
                                                                                          w - 1))
    moved = (b.wbytes("source", rows * w) + b.wbytes("target", rows * w))
    out = [b.program(f"{what} references {rows} x {w}", agreement._references,
                     (sparams, tparams, scfg, tcfg, tokens), dict(prefix=prefix), flops, moved, ("source", "target"))]
    v = tcfg.vocab_size
    logits = shapes.replicated((rows, cont, v), b.dtype, b.mesh)
    for progs in builders:  # the source's and the native target's logits stay alive while every arm runs
        out += [b.keeping(p, logits, logits) for p in progs]
    cache = b.cache("target", rows, w)
    student = b.fwd("target", rows, cont, prefix + cont / 2, cont)
    out.append(b.keeping(b.program(f"{what} student logits {rows} x {cont}", agreement._student,
                                   (tparams, tcfg, cache, b.tokens(rows, cont)), {}, student,
                                   b.wbytes("target", rows * cont)
                                   + b.kv_share("target", rows) * costs.kv_bytes(tcfg, rows, w, b.itemsize()),
                                   ("target",)), logits, logits))
    out.append(b.program(f"{what} comparison {rows} x {cont}", agreement._compare, (logits, logits, logits), {},
                         10.0 * rows * cont * v, 3 * shapes.nbytes(logits), ()))
    return out


def kl(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """The final map's KL and next-token agreement (agreement_table), and every other fitted map's KL
    (residual.heldout_window_kl)."""
    from kvjax.fitting.residual import heldout_window_kl
    from kvjax.run.layout import fitted_maps
    rows, prefix, cont = ec.batch_size, ec.prefix_len, ec.cont_len
    w = prefix + cont
    build = [b.prefill("source", rows, prefix - 1, w), b.apply_map(maps(final), rows, prefix - 1, w,
                                                                    name=f"{final} map")]
    out = _agreement(b, rows, prefix, cont, [build], "kl")
    (scfg, sparams), (tcfg, tparams) = b.source, b.target
    for name in fitted_maps(cfg):
        if name == final:
            continue
        m = maps(name)
        flops = (b.fwd("source", rows, w - 1, w / 2, cont) + costs.map_flops(m, rows, prefix - 1) * b.per_row(rows)
                 + b.fwd("target", rows, cont + 1, prefix + cont / 2, cont + 1))
        moved = (b.wbytes("source", rows * w) + b.wbytes("target", rows * cont))
        out.append(b.program(f"{name} map KL {rows} x {w}", heldout_window_kl,
                             (m, sparams, tparams, scfg, tcfg, b.tokens(rows, w)),
                             dict(prefix=prefix, teacher="source"), flops, moved, ("source", "target")))
    return out


def agreement(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """Every arm's next-token agreement on the kl evaluation's windows (agreement_table with each arm's builder)."""
    kc = cfg.eval.kl if cfg.eval.kl.enabled else cfg.eval.native_kl
    rows, prefix, cont = kc.batch_size, kc.prefix_len, kc.cont_len
    w = prefix + cont
    builders = [arm_programs(b, arm, maps, final, cfg, rows, prefix - 1, w) for arm in _arms(ec, cfg)]
    return _agreement(b, rows, prefix, cont, builders, "agreement")


def mc(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """score_mc_arms: each arm's cache of a batch of contexts (bucketed), repeated per option, then
    likelihood._continuation_logprobs over the options."""
    from kvjax.eval.likelihood import _continuation_logprobs
    out = []
    tcfg = b.target.cfg
    for schema, k in MC_OPTIONS.items():
        if not getattr(ec, schema):
            continue
        rows = min(ec.batch_size, ec.limit or ec.batch_size)
        for arm in _arms(ec, cfg):
            out += arm_programs(b, arm, maps, final, cfg, rows, MC_CONTEXT, MC_CONTEXT)
            who = "source" if arm == "source" else "target"
            m = b.model(who)
            cap = bucket(MC_CONTEXT + 1 + MC_OPTION)
            n = rows * k
            flops = b.fwd(who, n, 1 + MC_OPTION, MC_CONTEXT + MC_OPTION / 2, 1 + MC_OPTION)
            moved = (b.wbytes(who, n * (1 + MC_OPTION))
                     + b.kv_share(who, n) * costs.kv_bytes(m.cfg, n, cap, b.itemsize()))
            # the shared source cache of the batch and the arm's own cache stay alive beside the repeated one
            out.append(b.keeping(b.program(f"{who} option log-probs {n} x {1 + MC_OPTION}", _continuation_logprobs,
                                           (m.params, m.cfg, b.cache(who, n, cap), b.tokens(n, 1 + MC_OPTION),
                                            b.rows(n)), {}, flops, moved, (who,)),
                                 b.cache("source", rows, MC_CONTEXT), b.cache(who, rows, MC_CONTEXT)))
    del tcfg
    return out


def retrieval(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """score_retrieval_arms at each length: each arm's cache of the prompts, then arms._teacher_forced over the
    answer."""
    from kvjax.eval.arms import _teacher_forced
    out = []
    for length in ec.lengths:
        rows = min(ec.batch_size, ec.limit or ec.batch_size)
        t = bucket(length)
        for arm in _arms(ec, cfg):
            out += arm_programs(b, arm, maps, final, cfg, rows, t, t)
            who = "source" if arm == "source" else "target"
            m = b.model(who)
            cap = bucket(t + 1 + ANSWER)
            flops = b.fwd(who, rows, 1 + ANSWER, t, 1 + ANSWER)
            moved = (b.wbytes(who, rows * (1 + ANSWER))
                     + b.kv_share(who, rows) * costs.kv_bytes(m.cfg, rows, cap, b.itemsize()))
            out.append(b.keeping(b.program(f"{who} answer scores {rows} x {1 + ANSWER} after {t}", _teacher_forced,
                                           (m.params, m.cfg, b.cache(who, rows, cap), b.tokens(rows, 1 + ANSWER),
                                            b.rows(rows)), {}, flops, moved, (who,)),
                                 b.cache("source", rows, t), b.cache(who, rows, t)))
    return out


def _generate_programs(b: Builder, who: str, rows: int, capacity: int, new_tokens: int, context: int
                       ) -> list[Program]:
    """generate_from's answer phase: decode_jit for the first token, then generation.loop.decode_from (the whole
    greedy loop in one program)."""
    from kvjax.generation.loop import decode_from
    from kvjax.generation.sampling import Sampling
    m = b.model(who)
    out = [b.decode(who, rows, capacity, context)]
    step = out[0]
    logits = shapes.replicated((rows, m.cfg.vocab_size), jnp.float32, b.mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=shapes.replicated((), jnp.float32, b.mesh).sharding)
    n = new_tokens - 1
    out.append(b.program(f"{who} decode loop {rows} x {n} tokens over {capacity}", decode_from,
                         (m.params, m.cfg, b.cache(who, rows, capacity), logits, key),
                         dict(n=n, sampling=Sampling(), eos=(), pad=0), step.flops * n,
                         step.hbm_bytes * n, (who,)))
    return out


def throughput(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """measure_throughput at each length: the three paths (target, source, source prefill + map + target) through
    generate_from (builder, first token, decode loop), batch `batch_size`."""
    out = []
    rows = ec.batch_size
    for length in ec.lengths:
        cap = aligned(length + ec.new_tokens)
        for arm in ("target", "source", final):
            out += arm_programs(b, arm, maps, final, cfg, rows, length - 1, cap)
        out += _generate_programs(b, "target", rows, cap, ec.new_tokens, length)
        out += _generate_programs(b, "source", rows, cap, ec.new_tokens, length)
    return out


def native_kl(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """agreement_table with each arm's builder (unbucketed) on the windows: the answerer's KL to its own native
    predictions from each cache."""
    rows, prefix, cont = ec.batch_size, ec.prefix_len, ec.cont_len
    w = prefix + cont
    builders = [arm_programs(b, arm, maps, final, cfg, rows, prefix - 1, w) for arm in _arms(ec, cfg)]
    return _agreement(b, rows, prefix, cont, builders, "native KL")


TTFT_HEADROOM = 64  # kvjax.eval.first_token.measure_ttft's cache room past the prompt


def ttft(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """measure_ttft at each length: each timed builder (native target, mapped, and the repairs asked for) on the
    prompt but its last token, then the first token (decode_jit)."""
    rows = ec.batch_size
    arms = ["target", final] + (["partial"] if ec.repair else []) + (["tail"] if ec.tail else []) \
        + (["partial_tail"] if ec.partial_tail else [])
    out = []
    for length in ec.lengths:
        cap = length + TTFT_HEADROOM
        for arm in arms:
            out += arm_programs(b, arm, maps, final, cfg, rows, length - 1, cap)
        out.append(b.decode("target", rows, cap, length))
    return out


def run_loop(b: Builder, drafter, state, rows: int, capacity: int, new_tokens: int, what: str,
             draft_flops: float = 0.0, draft_bytes: float = 0.0) -> Program:
    """speculative.loop._run_loop as speculative_generate calls it: the verifier (the answering model; on CPU a tied
    head gets its [D, V] copy, as loop_verifier makes it), the drafter and its state, the verifier's cache of
    `capacity`, the prompts' last tokens. Priced as `new_tokens` rounds of one verify forward of draft_len + 1
    tokens (every draft rejected: the most rounds the loop can run)."""
    from kvjax.generation.sampling import Sampling
    from kvjax.models.model import Model
    from kvjax.speculative.loop import _run_loop
    verifier = b.target
    if verifier.params.lm_head is None and b.mesh.devices.flat[0].platform == "cpu":
        d, v = verifier.cfg.hidden_size, verifier.cfg.vocab_size
        verifier = Model(verifier.cfg, verifier.params.replace(lm_head=shapes.replicated((d, v), b.dtype, b.mesh)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=shapes.replicated((), jnp.float32, b.mesh).sharding)
    g = drafter.draft_len
    verify = b.prefill("target", rows, g + 1, capacity, cache=True, context=capacity // 2, logits=True,
                       last_only=False)
    return b.program(f"{what} speculative loop {rows} x {new_tokens} tokens, b = {g}, over {capacity}", _run_loop,
                     (verifier, drafter, b.cache("target", rows, capacity), state, b.rows(rows), key),
                     dict(max_new_tokens=new_tokens, sampling=Sampling(), eos_ids=(), pad_id=0),
                     new_tokens * (verify.flops + draft_flops), new_tokens * (verify.hbm_bytes + draft_bytes),
                     ("target", "source") if hasattr(drafter, "model") else ("target",))


def _abstract(b: Builder, tree):
    """ShapeDtypeStructs of an eval_shape result, placed replicated on the mesh (small per-row state), caches by
    their logical axes."""
    from kvjax.cache import KVCache, axes as cache_axes
    from kvjax import sharding

    def place(x):
        if isinstance(x, KVCache):
            return shapes.abstract(x, sharding.tree_shardings(x, cache_axes(x), b.mesh))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=shapes.replicated((), jnp.float32,
                                                                                      b.mesh).sharding), x)
    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, KVCache))


def speculative(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """measure_speculative (the reading model drafting for the answering one) at each length and draft length:
    the native arm (generate_from), plain drafting (the answerer's prefill, the drafter's own prefill, the loop),
    the transfer arms (the drafter's prefill, the map, the repair and the tail asked for, the loop) and prompt
    lookup (the answerer's prefill, the loop)."""
    from kvjax.eval.speculative_timing import _capacity
    from kvjax.speculative.draft import ModelDrafter
    from kvjax.speculative.lookup import LookupDrafter, LookupState
    rows, n = ec.batch_size, ec.new_tokens
    out = []
    for length in ec.lengths:
        t = length - 1
        cap = aligned(length + n)
        out += arm_programs(b, "target", maps, final, cfg, rows, t, cap)
        out += _generate_programs(b, "target", rows, cap, n, length)
        for g in ec.draft_lens:
            cap = _capacity(length, n, g)
            drafter = ModelDrafter(b.source, draft_len=g)
            small_cache = b.cache("source", rows, cap)
            state = _abstract(b, jax.eval_shape(drafter.from_cache, small_cache))
            step = b.decode("source", rows, cap, length)
            draft = (g * step.flops, g * step.hbm_bytes)
            out += [b.prefill("target", rows, t, cap), b.prefill("source", rows, t, cap),
                    run_loop(b, drafter, state, rows, cap, n, "plain", *draft)]
            arms = [final] + (["partial"] if ec.repair else []) + (["tail"] if ec.tail else [])
            for arm in arms:
                out += arm_programs(b, arm, maps, final, cfg, rows, t, cap)
            out.append(run_loop(b, drafter, state, rows, cap, n, "transfer", *draft))
            if ec.lookup:
                lookup = LookupDrafter(vocab_size=b.target.cfg.vocab_size, draft_len=g)
                # LookupDrafter.start's state: each row's history (prompt, then what is accepted) and its length
                lstate = LookupState(history=shapes.replicated((rows, cap + g + 1), jnp.int32, b.mesh),
                                     length=shapes.replicated((rows,), jnp.int32, b.mesh))
                out += [b.prefill("target", rows, t, cap), run_loop(b, lookup, lstate, rows, cap, n, "lookup")]
    return out


AUDIO_CLIP = 3000  # mel frames of a spoken prompt: the Whisper encoder's whole window (30 s), the longest one clip
AUDIO_ENDING = 64  # tokens of a spoken item's ending, bucketed


def audio_lm(b: Builder, who: str, shapes_dir: str, dtype):
    """An abstract AudioLM around the abstract `who` model: the adapter's encoder and projector from its Ultravox
    config.json (kvjax.hf.ultravox.audio_configs), replicated on the mesh as the adapter loads them."""
    from kvjax.models.audio_lm import AudioLM, init_projector
    from kvjax.hf.ultravox import audio_configs
    from kvjax.models.whisper import init_encoder
    c = audio_configs(shapes_dir, text_path=b.sources.get(who)) if b.sources.get(who) != shapes_dir else \
        audio_configs(shapes_dir)
    key = jax.random.key(0)
    enc = jax.eval_shape(lambda: init_encoder(c.encoder, key, dtype))
    proj = jax.eval_shape(lambda: init_projector(c.projector, key, dtype))
    rep = shapes.replicated((), jnp.float32, b.mesh).sharding
    place = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t)  # noqa: E731
    return AudioLM(encoder=place(enc), projector=place(proj), lm=b.model(who),
                   audio_token_index=c.audio_token_index if c.audio_token_index is not None else 0)


def _listen(b: Builder, who: str, alm, rows: int, length: int, capacity: int, what: str) -> list[Program]:
    """AudioPrefill's programs (kvjax.models.audio_lm.prefill_audio): the prompt's embeddings (encoder, projector,
    merge: prompt_embeddings_jit, one clip a row), then the model's prefill over them (prefill_jit with embeds)."""
    from kvjax.models.audio_lm import prompt_embeddings_jit
    from kvjax.models.decoder import prefill_jit
    enc = alm.encoder.cfg
    feats = shapes.replicated((rows, enc.num_mel_bins, AUDIO_CLIP), jnp.float32, b.mesh)
    d = alm.lm.cfg.hidden_size
    tokens, mask = b.tokens(rows, length), shapes.replicated((rows, length), jnp.bool_, b.mesh)
    enc_flops = 2.0 * rows * (AUDIO_CLIP // 2) * sum(
        x.size for x in jax.tree.leaves(alm.encoder.params) if len(x.shape) >= 2) / b.data
    embeds = shapes.replicated((rows, length, d), b.dtype, b.mesh)
    m = b.model(who)
    prefill = b.prefill(who, rows, length, capacity)
    return [b.program(f"{what} encoder and projector {rows} clips of {AUDIO_CLIP} frames", prompt_embeddings_jit,
                      (alm, tokens, mask, feats, b.rows(rows)), {}, enc_flops,
                      shapes.nbytes_per_device((alm.encoder.params, alm.projector.params)) + b.wbytes(who, 1, False),
                      (who,)),
            b.program(f"{what} prefill over audio embeddings {rows} x {length}", prefill_jit,
                      (m.params, m.cfg, embeds, b.rows(rows)),
                      dict(capacity=capacity, dtype=jnp.dtype(b.dtype), logits=None), prefill.flops,
                      prefill.hbm_bytes, (who,))]


def audio(b: Builder, ec, cfg, maps: _Maps, final: str) -> list[Program]:
    """The audio evaluation (kvjax.eval.suite.audio): the audio map trained on the source's listening (the pool's
    programs, the training step, its held-out KL and NLL) unless a saved one is given, every arm scored on the spoken
    items (each builder, then the endings' log-probs), and the spoken speed runs (one prompt, generate_from).
    Clips at the encoder's whole window; the adapters' shapes from the models' Ultravox config.json (the config's
    `shapes`)."""
    from kvjax.eval.likelihood import _continuation_logprobs
    from kvjax.fitting import audio_map as am
    from kvjax.models.audio_lm import audio_token_count
    src_alm = audio_lm(b, "source", cfg.source.shapes or ec.source_adapter, b.dtype)
    tgt_alm = audio_lm(b, "target", cfg.target.shapes or ec.target_adapter, b.dtype)
    prompt = 1 + int(audio_token_count(AUDIO_CLIP, 8)) + 1  # open, the clip's tokens, the line break
    p = bucket(prompt)
    rows = ec.batch_size
    out = []
    kvmap = maps(final)
    # the pools (the source listening to map_train's clips: its caches and teacher logits over the text after each
    # prompt), the map's held-out KL and NLL on them, and unless a saved map is given, its training step
    c = ec.map_cont
    pool = 16  # audio_pool's batch
    out += _listen(b, "source", src_alm, pool, prompt + c, prompt + c, "audio-map pool: source")
    v = b.source.cfg.vocab_size
    cache = b.cache("source", pool, prompt + c)
    teacher = shapes.replicated((pool, c, v), jnp.float32, b.mesh)
    text = b.tokens(pool, c + 1)
    student = b.fwd("target", pool, c, prompt, c) + costs.map_flops(kvmap, pool, prompt)
    moved = b.wbytes("target", pool * c) + costs.map_weight_bytes(kvmap)
    if not ec.map_from:
        opt = am.audio_optimizer(kvmap, ec.map_steps, ec.map_lr, ec.map_train_ridge)
        state = jax.eval_shape(opt.init, kvmap)
        rep = shapes.replicated((), jnp.float32, b.mesh).sharding
        state = shapes.abstract(state, jax.tree.map(lambda _: rep, state))
        out.append(b.program(f"audio-map training step {pool} x {c}", am.training_step(opt, b.target.cfg),
                             (kvmap, state, b.target.params, cache, teacher, text), {}, 3 * student, 2 * moved,
                             ("target",)))
    out += [b.program(f"audio-map KL {pool} x {c}", am._kl_jit, (kvmap, b.target.cfg, b.target.params, cache,
                                                                  teacher, text), {}, student, moved, ("target",)),
            b.program(f"audio-map NLL {pool} x {c}", am._nll_jit, (kvmap, b.target.cfg, b.target.params, cache,
                                                                    text), {}, student, moved, ("target",))]
    out += _listen(b, "target", tgt_alm, pool, prompt + c, prompt + c, "audio-map pool: target")
    for arm in ec.arms:  # each arm's cache of a batch of spoken prompts
        if arm in ("source_audio", "direct_audio", "text_map_audio", "mapped_audio"):
            out += _listen(b, "source", src_alm, rows, p, p, "source listens")
            if arm != "source_audio":
                out.append(b.apply_map(maps("direct") if arm == "direct_audio" else kvmap, rows, p, p,
                                       name=f"{arm} map"))
        elif arm == "target_audio":
            out += _listen(b, "target", tgt_alm, rows, p, p, "target listens")
        else:  # the transcripts' text arms
            out += arm_programs(b, {"target_text": "target", "source_text": "source", "mapped_text": final}[arm],
                                maps, final, cfg, rows, p, p)
    k = 4  # the spoken items' endings
    for who in ("source", "target"):
        m = b.model(who)
        n, cap = rows * k, bucket(p + 1 + AUDIO_ENDING)
        out.append(b.program(f"{who} ending log-probs {n} x {1 + AUDIO_ENDING}", _continuation_logprobs,
                             (m.params, m.cfg, b.cache(who, n, cap), b.tokens(n, 1 + AUDIO_ENDING), b.rows(n)), {},
                             b.fwd(who, n, 1 + AUDIO_ENDING, p, 1 + AUDIO_ENDING),
                             b.wbytes(who, n * AUDIO_ENDING), (who,)))
    cap = aligned(prompt + ec.speed_tokens)  # the speed runs: one spoken prompt, generate_from
    out += _listen(b, "source", src_alm, 1, prompt - 1, cap, "speed: source listens")
    out.append(b.apply_map(kvmap, 1, prompt - 1, cap, name="speed: audio map"))
    out += _listen(b, "target", tgt_alm, 1, prompt - 1, cap, "speed: target listens")
    out += _generate_programs(b, "target", 1, cap, ec.speed_tokens, prompt)
    return out


PLANS = {
    "distances": distances,
    "kl": kl,
    "agreement": agreement,
    "mc": mc,
    "retrieval": retrieval,
    "throughput": throughput,
    "native_kl": native_kl,
    "ttft": ttft,
    "speculative": speculative,
    "audio": audio,
}
