"""Train the residual on top of the frozen ridge map with teacher KL (the source's predictions by default).

A training window is prefix + continuation. The teacher reads the whole window (its next-token distributions on the
continuation): the source when it is the stronger model (large reads, small answers), or with `teacher="target"`
the target itself having read the prefix natively (small reads, large answers: the map should make the large model
behave as after its own prefill). The target reads the continuation from the *mapped* cache of the prefix
(the student). Only the residual parameters (down, res_bias, up; a context map's down_prev, a cross-position map's
attention) move; the ridge part stays frozen, unless `train_ridge` trains the whole map end to end. With
`rollout`, the continuation is the target's own greedy rollout from the mapped cache (the method's rollout-aware
correction), so the residual learns on the states it will actually decode from.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from tqdm import tqdm

from kvjax import aot
from kvjax import checkpointing, distributed, sharding
from kvjax.distributed import TokenWindows
from kvjax.generation import greedy_continuation
from kvjax.mapper.artifact import load_map, read_manifest
from kvjax.fitting.calibrate import model_on_mesh
from kvjax.fitting.copy_windows import COPY_SKIP, fact_format, fact_windows
from kvjax.models.model import Model
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import KVMap, apply_map, kvmap_shardings
from kvjax.fitting.residual_config import ResidualConfig
from kvjax.fitting.teacher_pool import Pool, build_pool, pool_of, teacher_logits
from kvjax.models.decoder import forward, prefill_forward
from kvjax.windows import step_batch, step_starts

log = logging.getLogger(__name__)
# the residual's leaves (down_prev: a context map's, att_*: a cross-position map's; None otherwise)
TRAINABLE = ("down", "res_bias", "up", "down_prev", "att_q", "att_k", "att_v", "att_o")
FROZEN = ("mu", "scale", "w_in", "w_out", "bias")
RIDGE = ("w_in", "w_out", "bias")  # the part of FROZEN that ResidualConfig.train_ridge trains (mu, scale: never)


def _labels(kvmap: KVMap, train_ridge: bool = False):
    def label(path, _):
        name = getattr(path[-1], "name", None)
        return "train" if name in TRAINABLE else "ridge" if train_ridge and name in RIDGE else "freeze"
    return jax.tree_util.tree_map_with_path(label, kvmap)


def moving(rc: ResidualConfig) -> tuple[str, ...]:
    """The map's leaves a training under `rc` moves."""
    return TRAINABLE + (RIDGE if rc.train_ridge else ())


def make_optimizer(rc: ResidualConfig, kvmap: KVMap) -> optax.GradientTransformation:
    def adam(scale):
        schedule = optax.warmup_cosine_decay_schedule(0.0, rc.lr * scale, rc.warmup_steps,
                                                      max(rc.steps, rc.warmup_steps + 1), end_value=rc.lr * scale * 0.1)
        return optax.chain(optax.clip_by_global_norm(rc.grad_clip), optax.adam(schedule))
    groups = {"train": adam(1.0), "freeze": optax.set_to_zero()}
    if rc.train_ridge:  # only then: a frozen-ridge optimizer's state is what it was before train_ridge existed
        groups["ridge"] = adam(rc.ridge_lr)
    return optax.multi_transform(groups, _labels(kvmap, rc.train_ridge))


def student_logits(kvmap: KVMap, target: Model, source_cache, tokens: jax.Array, prefix: int) -> jax.Array:
    """The target's logits [B, T', V] for tokens[:, prefix-1:-1] read after the mapped cache of tokens[:, :prefix-1]."""
    tcfg, tparams = target
    mapped = apply_map(kvmap, source_cache, capacity=tokens.shape[1], length=prefix - 1)
    return forward(tparams, tcfg, tokens[:, prefix - 1 : -1], mapped).logits


def position_kl(kvmap: KVMap, source: Model, target: Model, tokens: jax.Array, prefix: int,
                teacher: str = "source") -> jax.Array:
    """KL [B, T - prefix] of the target-from-mapped-cache vs the teacher at each continuation position of
    tokens[:, prefix:] (traceable). `teacher`: "source" (the reader's predictions) or "target" (the answerer's own,
    having read the prefix natively: the teacher when the reader is the weaker model)."""
    scfg, sparams = source
    tmodel = {"source": source, "target": target}[teacher]
    teacher_logits = forward(tmodel[1], tmodel[0], tokens[:, :-1]).logits[:, prefix - 1 :]
    teacher = jax.lax.stop_gradient(teacher_logits)
    src_cache = jax.lax.stop_gradient(prefill_forward(sparams, scfg, tokens[:, : prefix - 1], logits=None).cache)
    return kl(teacher, student_logits(kvmap, target, src_cache, tokens, prefix))


def window_kl(kvmap: KVMap, source: Model, target: Model, tokens: jax.Array, prefix: int,
              teacher: str = "source") -> jax.Array:
    """Mean KL per window [B] of the target-from-mapped-cache vs the teacher ("source" or "target", see
    position_kl), over the continuation tokens[:, prefix:] (traceable)."""
    return position_kl(kvmap, source, target, tokens, prefix, teacher).mean(-1)


def rollout_windows(kvmap: KVMap, source: Model, target: Model, prefix_tokens: jax.Array, n: int) -> jax.Array:
    """prefix + the target's greedy continuation of n tokens (kvjax.generation.greedy_continuation) from the mapped
    cache of prefix[:-1] (traceable)."""
    (scfg, sparams), (tcfg, tparams) = source, target
    p = prefix_tokens.shape[1]
    source_cache = prefill_forward(sparams, scfg, prefix_tokens[:, :-1], logits=None).cache
    mapped = apply_map(kvmap, source_cache, capacity=p + n, length=p - 1)
    return jnp.concatenate([prefix_tokens, greedy_continuation(tparams, tcfg, mapped, prefix_tokens[:, -1], n)], axis=1)


@functools.partial(aot.jit, static_argnames=("source_cfg", "target_cfg", "prefix", "teacher"))
def heldout_window_kl(kvmap, source_params, target_params, source_cfg, target_cfg, tokens, prefix: int,
                      teacher: str = "source"):
    return window_kl(kvmap, (source_cfg, source_params), (target_cfg, target_params), tokens, prefix, teacher)


@functools.partial(aot.jit, static_argnames=("source_cfg", "target_cfg", "prefix", "teacher"))
def heldout_position_kl(kvmap, source_params, target_params, source_cfg, target_cfg, tokens, prefix: int,
                        teacher: str = "source"):
    return position_kl(kvmap, (source_cfg, source_params), (target_cfg, target_params), tokens, prefix, teacher)


def evaluate_kl(kvmap: KVMap, source: Model, target: Model, windows: np.ndarray, prefix: int,
                batch_size: int = 8, per_position: bool = False, teacher: str = "source") -> np.ndarray:
    """Per-window KL [N] (nats/token) on held-out windows int [N, prefix + cont]; with `per_position`, the KL at
    each continuation position [N, cont] instead (e.g. how much the map helps the first generated tokens).
    `teacher`: see position_kl."""
    (scfg, sparams), (tcfg, tparams) = source, target
    fn = heldout_position_kl if per_position else heldout_window_kl
    out = []
    for i in range(0, len(windows), batch_size):
        batch = jnp.asarray(windows[i : i + batch_size], jnp.int32)
        out.append(np.asarray(fn(kvmap, sparams, tparams, scfg, tcfg, batch, prefix, teacher)))
    return np.concatenate(out)


def _step_fn(opt: optax.GradientTransformation, rc: ResidualConfig, scfg, tcfg):
    def step(kvmap, opt_state, sparams, tparams, tokens):
        source, target = (scfg, sparams), (tcfg, tparams)
        if rc.rollout:
            tokens = rollout_windows(kvmap, source, target, tokens[:, : rc.prefix_len], rc.cont_len)
        loss, grads = jax.value_and_grad(
            lambda m: window_kl(m, source, target, tokens, rc.prefix_len, rc.teacher).mean())(kvmap)
        updates, opt_state = opt.update(grads, opt_state, kvmap)
        return optax.apply_updates(kvmap, updates), opt_state, loss
    return step


def pooled_kl(kvmap: KVMap, source: Model, target: Model, batch, prefix: int, teacher: str = "source",
              skip: int = 0, period: int = 0) -> jax.Array:
    """Mean KL of the target-from-mapped-cache vs the teacher on a Pool batch (tokens, source cache, teacher hidden
    states) of windows of `prefix` + continuation tokens, the first `skip` continuation positions left out (with
    `period`: the first `skip` of every `period` positions, e.g. of each repeated fact)."""
    tokens, src_cache, hidden = batch
    logits = jax.lax.stop_gradient(teacher_logits(source if teacher == "source" else target, hidden))
    per_position = kl(logits, student_logits(kvmap, target, src_cache, tokens, prefix))
    if period:
        return per_position.reshape(per_position.shape[0], -1, period)[:, :, skip:].mean()
    return (per_position[:, skip:] if skip else per_position).mean()


def _pooled_step_fn(opt: optax.GradientTransformation, rc: ResidualConfig, scfg, tcfg):
    """The step on a batch of a Pool (kvjax.fitting.teacher_pool): the frozen models' outputs are read, not run."""
    def step(kvmap, opt_state, sparams, tparams, batch):
        source, target = (scfg, sparams), (tcfg, tparams)
        loss, grads = jax.value_and_grad(lambda m: pooled_kl(m, source, target, batch, rc.prefix_len,
                                                             rc.teacher))(kvmap)
        updates, opt_state = opt.update(grads, opt_state, kvmap)
        return optax.apply_updates(kvmap, updates), opt_state, loss
    return step


def _copy_step_fn(opt: optax.GradientTransformation, rc: ResidualConfig, scfg, tcfg, pooled: bool):
    """The step with fact-copy windows mixed in (rc.copy_windows): (1 - copy_weight) x the ordinary KL (streaming or
    on the text pool) + copy_weight x the KL on the copies' repeats after COPY_SKIP tokens of each. Returns (map, state,
    (ordinary KL, copy KL))."""
    def step(kvmap, opt_state, sparams, tparams, batch, copy_batch):
        source, target = (scfg, sparams), (tcfg, tparams)

        def loss(m):
            text = (pooled_kl(m, source, target, batch, rc.prefix_len, rc.teacher) if pooled else
                    window_kl(m, source, target, batch, rc.prefix_len, rc.teacher).mean())
            # one fact: the plain skip, the reduction the shipped maps were trained with (bit for bit)
            copy = pooled_kl(m, source, target, copy_batch, rc.copy_len, rc.teacher, skip=COPY_SKIP,
                             period=rc.copy_span if rc.copy_facts > 1 else 0)
            return (1.0 - rc.copy_weight) * text + rc.copy_weight * copy, (text, copy)
        (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(kvmap)
        updates, opt_state = opt.update(grads, opt_state, kvmap)
        return optax.apply_updates(kvmap, updates), opt_state, parts
    return step


def copy_pool(source: Model, target: Model, tokens: np.ndarray, rc: ResidualConfig, tokenizer) -> Pool:
    """rc.copy_windows fact-copy windows (kvjax.fitting.copy_windows) of `tokens` with the frozen models' outputs; the
    fact's separator and value alphabet are rc's text under the pair's `tokenizer`."""
    if tokenizer is None:
        raise ValueError("residual.copy_windows needs the pair's tokenizer to write its facts (train_residual(..., "
                         "tokenizer=kvjax.load_tokenizer(target_path))); or set residual.copy_windows=0")
    fmt = fact_format(tokenizer, rc.copy_separator, rc.copy_values, rc.copy_avoid)
    windows, _ = fact_windows(tokens, rc.copy_windows, rc.copy_len, rc.copy_span, fmt, rc.seed, rc.copy_facts)
    return pool_of(source, target, windows, rc.copy_len, rc.teacher)


def _sha256(kvmap: KVMap, names: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for lm in (*kvmap.keys, *kvmap.values):
        for name in names:
            if getattr(lm, name) is not None:
                digest.update(np.ascontiguousarray(jax.device_get(getattr(lm, name)), np.float32).tobytes())
    return digest.hexdigest()


def with_context(kvmap: KVMap, context: int, seed: int, kinds: str = "kv") -> KVMap:
    """`kvmap` made a context map reading `context` previous positions (ResidualConfig.context) in its key maps, its
    value maps or both (`kinds`: "k", "v" or "kv"; ResidualConfig.context_kinds): each such layer's `down_prev` drawn
    fresh (a pure function of `seed`, the same draw whatever `kinds`) beside its residual, which is kept; with `up`
    still zero the map is unchanged. A map that already reads `context` positions where `kinds` asks is returned as it
    is; one reading another number, or in other maps, is refused."""
    want = [context if "k" in kinds else 0] * len(kvmap.keys) + [context if "v" in kinds else 0] * len(kvmap.values)
    have = [m.context for m in (*kvmap.keys, *kvmap.values)]
    if have == want:
        return kvmap
    if any(have):
        raise ValueError(f"this map's residual reads {sorted(set(have))} previous positions in its "
                         f"{'key and value' if all(have) else 'key' if have[0] else 'value'} maps, not "
                         f"residual.context={context} in residual.context_kinds={kinds!r}; train from its ridge (a "
                         "fresh residual) or set residual.context and residual.context_kinds to match")
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0x6374), len(kvmap.keys) + len(kvmap.values))

    def widen(m, key, on):  # drawn as the residual's own `down` is (kvjax.mapper.kvmap.linear_map)
        if not on:
            return m
        fx, h = m.down.shape
        prev = np.asarray(jax.random.normal(key, (context, fx, h), jnp.float32) / np.sqrt(fx))
        if isinstance(m.down, jax.Array) and m.down.is_fully_addressable:  # placed as the map (a mesh run re-places)
            prev = jax.device_put(prev, m.down.sharding)
        return m.replace(down_prev=prev)
    n = len(kvmap.keys)
    return kvmap.replace(keys=tuple(widen(m, keys[i], "k" in kinds) for i, m in enumerate(kvmap.keys)),
                         values=tuple(widen(m, keys[n + i], "v" in kinds) for i, m in enumerate(kvmap.values)))


def with_attention(kvmap: KVMap, heads: int, dim: int, seed: int) -> KVMap:
    """`kvmap` made a cross-position map (ResidualConfig.attention_heads): each layer's residual also reads a causal
    attention of `heads` x `dim` over every earlier position (kvjax.mapper.kvmap), its queries, keys and values drawn
    fresh (a pure function of `seed`) and its output projection zero, so the map is unchanged until it trains. A map
    that already attends with these sizes is returned as it is; other sizes are refused."""
    have = {None if m.att_q is None else (m.att_q.shape[0], m.att_q.shape[2]) for m in (*kvmap.keys, *kvmap.values)}
    if have == {(heads, dim)}:
        return kvmap
    if have != {None}:
        raise ValueError(f"this map's residual attends with (heads, width) {sorted(have, key=str)}, not residual."
                         f"attention_heads={heads} x attention_dim={dim}; train from its ridge or match the sizes")
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0x6174), len(kvmap.keys) + len(kvmap.values))

    def add(m, key):
        fx, h = m.down.shape
        q, k, v = (np.asarray(jax.random.normal(kk, (heads, fx, dim), jnp.float32) / np.sqrt(fx))
                   for kk in jax.random.split(key, 3))
        arrays = dict(att_q=q, att_k=k, att_v=v, att_o=np.zeros((heads, dim, h), np.float32))
        if isinstance(m.down, jax.Array) and m.down.is_fully_addressable:  # placed as the map (a mesh run re-places)
            arrays = {n: jax.device_put(a, m.down.sharding) for n, a in arrays.items()}
        return m.replace(**arrays)
    n = len(kvmap.keys)
    return kvmap.replace(keys=tuple(add(m, keys[i]) for i, m in enumerate(kvmap.keys)),
                         values=tuple(add(m, keys[n + i]) for i, m in enumerate(kvmap.values)))


def warm_start(kvmap: KVMap, path: str) -> KVMap:
    """`kvmap` with the residual (down, res_bias, up) of the map saved at `path` (ResidualConfig.init_from), each
    array placed as `kvmap`'s. Refuses a map of other models, pairing or residual rank, or of another frozen ridge
    part: its residual was trained on top of that ridge and means nothing on this one."""
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise ValueError(f"residual.init_from={path!r} is not a saved map (no manifest.json); pass the directory of a "
                         "map saved by kvjax.save_map (e.g. a run's map/) or '' for a fresh residual")
    manifest = read_manifest(path)
    spec = manifest["spec"]
    att = kvmap.keys[0].att_q
    mine = (kvmap.spec.source_fingerprint, kvmap.spec.target_fingerprint, kvmap.spec.residual_rank,
            (kvmap.keys[0].context, kvmap.values[0].context), 0 if att is None else att.shape[0],
            [list(p) for p in kvmap.spec.pairing])
    value_layers = manifest.get("value_layers", manifest["layers"])  # (maps saved before it was written: the same)
    theirs = (spec["source_fingerprint"], spec["target_fingerprint"], spec["residual_rank"],
              (manifest["layers"][0].get("context", 0), value_layers[0].get("context", 0)),
              manifest["layers"][0].get("heads", 0), [list(p) for p in spec["pairing"]])
    if mine != theirs:
        raise ValueError(f"residual.init_from={path!r} is a map of other models, pairing, residual rank, context or "
                         f"attention (source, target, rank, context of keys and values, heads {theirs[:5]} vs this "
                         f"map's {mine[:5]}); start from a map fitted on this run's ridge with the same "
                         "residual.context, residual.context_kinds and residual.attention_heads, or '' for a fresh "
                         "residual")
    init = load_map(path)
    if _sha256(init, FROZEN) != _sha256(kvmap, FROZEN):
        raise ValueError(f"residual.init_from={path!r} was trained on another ridge fit (its frozen part differs from "
                         "this map's); start from a residual of this run's ridge, or '' for a fresh residual")

    def take(mine, theirs):
        place = lambda new, old: jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new  # noqa
        return mine.replace(**{n: place(getattr(theirs, n), getattr(mine, n)) for n in TRAINABLE
                               if getattr(mine, n) is not None})
    return kvmap.replace(keys=tuple(map(take, kvmap.keys, init.keys)),
                         values=tuple(map(take, kvmap.values, init.values)))


def ema_update(decay: float, names: tuple[str, ...] = TRAINABLE):
    """(average, live map) -> the average moved towards the live map by 1 - decay in the trained parameters `names`
    (`moving(rc)`); the frozen part is kept as it is (bit-exact: decay * x + (1 - decay) * x need not round to x)."""
    def mix(avg, live):
        return avg.replace(**{n: decay * getattr(avg, n) + (1.0 - decay) * getattr(live, n) for n in names
                              if getattr(avg, n) is not None})

    @aot.jit
    def update(avg: KVMap, live: KVMap) -> KVMap:
        return avg.replace(keys=tuple(map(mix, avg.keys, live.keys)), values=tuple(map(mix, avg.values, live.values)))
    return update


def run_identity(kvmap: KVMap, rc: ResidualConfig) -> dict:
    """What a residual checkpoint belongs to: the map's models and pairing, a hash of its frozen (ridge) part and the
    training settings (with `init_from`, a hash of the residual it starts from too: the path alone may be rewritten).
    Resuming from a checkpoint of another identity would silently continue another run."""
    settings = {k: v for k, v in rc.hashed().items() if k != "save_every"}
    identity = {"map": kvmap.map_id, "pairing": kvmap.spec.pairing, "residual_rank": kvmap.spec.residual_rank,
                "ridge_sha256": _sha256(kvmap, FROZEN), "settings": settings}
    if rc.init_from:
        identity["init_sha256"] = _sha256(kvmap, TRAINABLE)
    return json.loads(json.dumps(identity))  # as it reads back from residual_identity.json (tuples -> lists)


def _check_identity(workdir: str, identity: dict, has_checkpoint: bool) -> None:
    path = os.path.join(workdir, "residual_identity.json")
    stored = None
    if os.path.isfile(path):
        with open(path) as f:
            stored = json.load(f)
    if has_checkpoint and stored != identity:
        what = ("it has no residual_identity.json (an older kvjax)" if stored is None else
                "it differs in " + ", ".join(k for k in identity if stored.get(k) != identity[k]))
        raise ValueError(f"{workdir}/residual_ckpt holds a residual checkpoint of another run ({what}); resuming from "
                         f"it would continue that run. Delete {workdir}/residual_ckpt or pass another workdir.")
    if stored is None and distributed.is_primary():
        os.makedirs(workdir, exist_ok=True)
        with open(path + ".tmp", "w") as f:  # atomic: other processes may be reading it
            json.dump(identity, f, indent=1)
        os.replace(path + ".tmp", path)


def restore_target(tree):
    """Shapes, dtypes and shardings to restore a checkpoint of `tree` into: this run's placement, given explicitly.
    Without a sharding orbax reuses the one saved in the checkpoint, which fails ("topology mismatch") when a run
    resumes on another mesh or process count; host arrays go to this process's first device."""
    def leaf(x):
        where = x.sharding if isinstance(x, jax.Array) else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=where)
    return jax.tree.map(leaf, tree)


def _logged(step: int, losses: dict) -> dict:
    """A step's log line: its losses read from the device (waits for the step)."""
    return {"step": step, **{k: float(v) for k, v in losses.items()}}


def training_step(kvmap: KVMap, source: Model, target: Model, rc: ResidualConfig, opt: optax.GradientTransformation,
                  mesh: Mesh | None = None, pooled: bool = False, copies: bool = False):
    """The compiled training step `train_residual` runs, and its shardings: (step, None) on one device, or
    (step, (map, optimizer state, batch shardings)) data-parallel on `mesh`, where the step takes and returns the
    map and optimizer state placed by their logical axes and the models as they are placed (their shardings are
    read from `source` / `target`, arrays or ShapeDtypeStructs: kvjax.plan compiles it without weights). `pooled`:
    the step reads a teacher pool's batch (kvjax.fitting.teacher_pool); `copies`: it also reads fact-copy windows."""
    scfg, tcfg = source[0], target[0]
    if copies:
        step_fn = _copy_step_fn(opt, rc, scfg, tcfg, pooled=pooled)
    else:
        step_fn = (_pooled_step_fn if pooled else _step_fn)(opt, rc, scfg, tcfg)
    if mesh is None:
        return aot.jit(step_fn), None
    map_sh = kvmap_shardings(kvmap, mesh)
    opt_sh = sharding.optimizer_shardings(opt, kvmap, map_sh, mesh)
    batch_sh = sharding.data_sharding(mesh, (rc.batch_size, rc.prefix_len + rc.cont_len))
    params_sh = lambda p: jax.tree.map(lambda x: x.sharding, p)  # noqa: E731
    step = aot.jit(step_fn, in_shardings=(map_sh, opt_sh, params_sh(source[1]), params_sh(target[1]), batch_sh),
                   out_shardings=(map_sh, opt_sh, sharding.replicated(mesh)))
    return step, (map_sh, opt_sh, batch_sh)


def train_residual(kvmap: KVMap, source: Model, target: Model, tokens: np.ndarray, rc: ResidualConfig,
                   workdir: str | None = None, stop_at: int | None = None,
                   mesh: Mesh | None = None, tokenizer=None) -> tuple[KVMap, list[dict]]:
    """Train the residual on windows cut from a token array (uniformly, a pure function of (seed, step)); resumes
    from `workdir` checkpoints; `stop_at` ends this run early after that step. Returns (map, this run's log): the
    last iterate, or with `rc.ema` the moving average of the iterates.

    With `mesh`, training is data-parallel: each step's global batch of `rc.batch_size` windows is split over the
    'data' axis (each process reads only its own windows), the models are sharded over 'model', the map and the
    optimizer state are placed by their logical axes (replicated), and the step is one jit with in/out shardings,
    compiled once; the result equals single-device training up to float rounding. In a multi-process run every
    process calls this (checkpoints are written jointly through orbax, `workdir` must be on a shared filesystem);
    only process 0 writes the log file.

    With `rc.copy_windows`, each step also reads `rc.copy_batch` fact-copy windows (kvjax.fitting.copy_windows; their
    fact format is tokenized with `tokenizer`, the pair's) from a pool made once, on one process; the log's "kl" is
    then the ordinary windows' KL and "copy_kl" the copies'."""
    if rc.context:
        kvmap = with_context(kvmap, rc.context, rc.seed, rc.context_kinds)
    if rc.attention_heads:
        kvmap = with_attention(kvmap, rc.attention_heads, rc.attention_dim, rc.seed)
    if rc.init_from:
        kvmap = warm_start(kvmap, rc.init_from)
    identity = None if workdir is None else run_identity(kvmap, rc)  # before any placement on a mesh
    opt = make_optimizer(rc, kvmap)
    window = rc.prefix_len + rc.cont_len
    (_, sparams), (_, tparams) = source, target
    pool = copies = None
    pooled = [n for n in ("pool_windows", "copy_windows") if getattr(rc, n)]
    if pooled and (rc.rollout or jax.process_count() > 1):
        # a rollout's continuation changes with the map (and would replace the copies' repeats); a pool is made once,
        # in one process's memory
        raise ValueError(f"residual.{' and residual.'.join(pooled)} need rollout=False and one process; set "
                         + " and ".join(f"residual.{n}=0" for n in pooled))
    if pooled:
        mesh = None  # one process: the pooled step runs where the models and the map are placed
    if rc.pool_windows:
        pool = build_pool(source, target, tokens, rc.pool_windows, rc.prefix_len, rc.cont_len, rc.seed, rc.teacher)
    if rc.copy_windows:
        copies = copy_pool(source, target, tokens, rc, tokenizer)
    if mesh is not None:
        source, target = model_on_mesh(source, mesh), model_on_mesh(target, mesh)
        (_, sparams), (_, tparams) = source, target
    step, shardings = training_step(kvmap, source, target, rc, opt, mesh=mesh, pooled=pool is not None,
                                    copies=copies is not None)
    if mesh is None:
        opt_state = opt.init(kvmap)
        first = jax.tree.leaves(kvmap)[0]
        if getattr(first, "committed", False):
            # placed as the map is, as the step's outputs will be: an uncommitted state next to a committed (loaded)
            # map makes the step compile a second time at step 2 (~100 s on a loaded 2-core machine)
            opt_state = jax.device_put(opt_state, first.sharding)
    else:
        map_sh, opt_sh, batch_sh = shardings
        kvmap = sharding.place(kvmap, map_sh)
        opt_state = aot.jit(opt.init, out_shardings=opt_sh)(kvmap)

    # with rc.ema the average rides along in the checkpoint (a resumed run continues the same average)
    average, averaged = (kvmap, ema_update(rc.ema, moving(rc))) if rc.ema > 0 else (None, None)
    state = lambda: (kvmap, opt_state) if average is None else (kvmap, opt_state, average)  # noqa: E731
    start, manager = 0, None
    if workdir is not None:
        manager = checkpointing.manager(os.path.join(workdir, "residual_ckpt"))
        _check_identity(workdir, identity, manager.latest_step() is not None)
        if manager.latest_step() is not None:
            start = manager.latest_step()
            restored = manager.restore(start, args=ocp.args.StandardRestore(restore_target(state())))
            kvmap, opt_state, average = restored if average is not None else (*restored, None)
            log.info("residual: resumed from step %d", start)
    history, pending = [], None
    end = rc.steps if stop_at is None else min(stop_at, rc.steps)
    bar = tqdm(range(start, end), initial=start, total=rc.steps, desc="train residual", unit="step",
               disable=not distributed.is_primary())
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        for i in bar:
            if pool is not None:
                batch = pool.batch(i, rc.batch_size, rc.seed)
            elif mesh is None:
                batch = jnp.asarray(step_batch(tokens, i, rc.batch_size, window, rc.seed))
            else:
                rows = TokenWindows(tokens, step_starts(len(tokens), i, rc.batch_size, window, rc.seed), window)
                batch = distributed.global_batch(rows, batch_sh, (rc.batch_size, window))
            if copies is None:
                kvmap, opt_state, loss = step(kvmap, opt_state, sparams, tparams, batch)
                losses = {"kl": loss}
            else:  # the copy pool's own order: (seed + 1, epoch), as the text pool's is (seed, epoch)
                kvmap, opt_state, (loss, copy) = step(kvmap, opt_state, sparams, tparams, batch,
                                                      copies.batch(i, rc.copy_batch, rc.seed + 1))
                losses = {"kl": loss, "copy_kl": copy}
            # the step runs while the next batch is gathered on the host: read a step's losses one step later
            # (reading them now would wait for it), never later (the queue of dispatched steps stays one deep)
            if pending is not None:
                history.append(_logged(*pending))
            pending = (i + 1, losses)
            if average is not None:
                average = averaged(average, kvmap)
            distributed.heartbeat()
            if manager is not None and ((i + 1) % rc.save_every == 0 or i + 1 == end):
                manager.save(i + 1, args=ocp.args.StandardSave(state()))
        if pending is not None:
            history.append(_logged(*pending))
    if manager is not None:
        manager.wait_until_finished()
        if distributed.is_primary():
            with open(os.path.join(workdir, "residual_log.jsonl"), "a") as f:
                f.writelines(json.dumps(h) + "\n" for h in history)
    return (kvmap if average is None else average), history
