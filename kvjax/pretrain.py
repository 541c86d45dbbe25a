"""Language-model pretraining with the project's own Qwen3 forward and optax (used for the toy pair).

AdamW with linear warmup and cosine decay, gradient clipping, orbax checkpoints every `save_every` steps, exact
resumption (batches are a pure function of (seed, step)), held-out loss every `eval_every` steps, a progress bar,
and a loss curve (metrics.jsonl + loss.png) in the work directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from kvjax import aot
from kvjax import checkpointing
from kvjax.models.family import DecoderConfig
from kvjax.models.params import Params, init_params
from kvjax.models.decoder import forward
from kvjax.pretrain_config import TrainConfig
from kvjax.windows import step_batch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainState:
    params: Params
    opt_state: optax.OptState
    step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "opt_state", "step"], meta_fields=[])


def lm_loss(params: Params, cfg: DecoderConfig, windows: jax.Array, remat: bool = False) -> jax.Array:
    """Mean next-token cross-entropy (nats) of windows int [B, T+1]."""
    logits = forward(params, cfg, windows[:, :-1], remat=remat).logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, max(tc.steps, tc.warmup_steps + 1),
                                                  end_value=tc.lr * tc.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(schedule, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask))


def batch_at(data: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int, copy_prob: float = 0.0,
             copy_spans: int = 4, copy_len: tuple[int, int] = (16, 64),
             copy_gap: tuple[int, int] | None = None, copy_random: float = 0.0, repeat_prob: float = 0.0,
             repeat_span: int = 128, copy_values: tuple[int, ...] = (), copy_value_frac: float = 0.0,
             copy_cue: tuple[int, int] = (2, 6), copy_sep: tuple[int, ...] = ()) -> np.ndarray:
    """Windows [B, seq_len + 1] drawn uniformly from `data` (``kvjax.windows.step_batch``); a pure function of
    (seed, step) so runs resume exactly.
    With copy_prob > 0, that fraction of windows gets `copy_spans` spans repeated later in the window (see
    TrainConfig.copy_prob; copy_values/copy_value_frac/copy_cue/copy_sep shape some random spans as key, separator,
    value); with repeat_prob > 0, that fraction is replaced by random tokens of `data` repeated with period
    `repeat_span` (TrainConfig.repeat_prob)."""
    batch = step_batch(data, step, batch_size, seq_len + 1, seed)
    if copy_prob > 0:
        lo, hi = copy_len
        if not 0 < lo <= hi or 2 * hi >= seq_len:
            raise ValueError(f"copy_len {copy_len} must satisfy 0 < lo <= hi < seq_len / 2 = {seq_len / 2}")
        if copy_gap is not None and not 0 <= copy_gap[0] <= copy_gap[1] <= seq_len + 1 - 2 * hi:
            raise ValueError(f"copy_gap {copy_gap} must satisfy 0 <= lo <= hi <= seq_len + 1 - 2 * copy_len[1] = "
                             f"{seq_len + 1 - 2 * hi}")
        if copy_value_frac > 0 and (not copy_values or not 0 < copy_cue[0] <= copy_cue[1] < lo - len(copy_sep)):
            raise ValueError(f"copy_value_frac > 0 needs token ids in copy_values (have {len(copy_values)}) and a cue "
                             f"0 < copy_cue[0] <= copy_cue[1] < copy_len[0] - len(copy_sep) (have copy_cue {copy_cue}, "
                             f"copy_len {copy_len}, {len(copy_sep)} separator tokens)")
        values, sep = np.asarray(copy_values, np.int32), np.asarray(copy_sep, np.int32)
        aug = np.random.default_rng([seed, step, 1])
        for row in np.flatnonzero(aug.random(batch_size) < copy_prob):
            for _ in range(copy_spans):
                n = int(aug.integers(lo, hi + 1))
                if copy_gap is None:
                    src = int(aug.integers(0, seq_len + 1 - 2 * n))
                    dst = int(aug.integers(src + n, seq_len + 2 - n))
                else:
                    gap = int(aug.integers(copy_gap[0], copy_gap[1] + 1))
                    src = int(aug.integers(0, seq_len + 2 - 2 * n - gap))
                    dst = src + n + gap
                if copy_random > 0 and aug.random() < copy_random:
                    batch[row, src : src + n] = batch[row, aug.integers(0, seq_len + 1, n)]
                    if copy_value_frac > 0 and aug.random() < copy_value_frac:
                        cue = src + int(aug.integers(copy_cue[0], copy_cue[1] + 1))
                        batch[row, cue : cue + len(sep)] = sep
                        batch[row, cue + len(sep) : src + n] = values[aug.integers(0, len(values), src + n - cue
                                                                                   - len(sep))]
                batch[row, dst : dst + n] = batch[row, src : src + n]
    if repeat_prob > 0:
        if not 0 < 2 * repeat_span <= seq_len + 1:
            raise ValueError(f"repeat_span {repeat_span} must fit at least twice in a window of {seq_len + 1} tokens")
        rep = np.random.default_rng([seed, step, 2])
        for row in np.flatnonzero(rep.random(batch_size) < repeat_prob):
            span = data[rep.integers(0, len(data), repeat_span)].astype(np.int32)
            batch[row] = np.tile(span, -(-(seq_len + 1) // repeat_span))[: seq_len + 1]
    return batch


def init_state(cfg: DecoderConfig, tc: TrainConfig, params: Params | None = None) -> TrainState:
    """Fresh optimizer state and step 0, on random weights or on `params` (continued training, new schedule)."""
    if params is None:
        params = init_params(cfg, jax.random.key(tc.seed), std=tc.init_std)
    return TrainState(params, make_optimizer(tc).init(params), jnp.zeros((), jnp.int32))


def make_train_step(cfg: DecoderConfig, tc: TrainConfig):
    opt = make_optimizer(tc)

    def step_fn(state: TrainState, windows):
        loss, grads = jax.value_and_grad(lm_loss)(state.params, cfg, windows, tc.remat)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return aot.jit(step_fn, donate_argnums=0)


def evaluate(params: Params, cfg: DecoderConfig, batches: list[np.ndarray]) -> float:
    loss = aot.jit(lm_loss, static_argnums=(1,))
    return float(np.mean([loss(params, cfg, b) for b in batches]))


def train(cfg: DecoderConfig, tc: TrainConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray, workdir: str,
          name: str = "model", stop_at: int | None = None, init: Params | None = None) -> Params:
    """Train (or resume training) a model in `workdir`; returns the params. `stop_at` ends this run early after that
    step (checkpointed); a later call resumes towards `tc.steps`. `init` starts from given weights instead of random
    ones (a second training phase with its own schedule; a checkpoint in `workdir` still takes precedence)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "train_config.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(cfg), "train": dataclasses.asdict(tc)}, f, indent=2)
    manager = checkpointing.manager(os.path.join(workdir, "ckpt"))
    state = init_state(cfg, tc, init)
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
        log.info("%s: resumed from step %d", name, start)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    _truncate_metrics(metrics_path, start)
    eval_batches = [batch_at(heldout_tokens, i, tc.batch_size, tc.seq_len, seed=10_000 + i)
                    for i in range(tc.eval_batches)]
    step_fn = make_train_step(cfg, tc)
    end = min(tc.steps if stop_at is None else stop_at, tc.steps if tc.end_at is None else tc.end_at, tc.steps)
    bar = tqdm(range(start, end), initial=start, total=tc.steps, desc=f"train {name}", unit="step",
               dynamic_ncols=True)
    t_last = time.perf_counter()
    with open(metrics_path, "a") as metrics_file:
        for step in bar:
            state, m = step_fn(state, batch_at(train_tokens, step, tc.batch_size, tc.seq_len, tc.seed, tc.copy_prob,
                                                        tc.copy_spans, tc.copy_len, tc.copy_gap,
                                                        tc.copy_random, tc.repeat_prob, tc.repeat_span,
                                                        tc.copy_values, tc.copy_value_frac, tc.copy_cue,
                                                        tc.copy_sep))
            loss = float(m["loss"])  # one sync per step keeps the progress bar and the timings honest
            done = step + 1
            if done % tc.eval_every == 0 or done in (tc.steps, tc.end_at):
                seconds = time.perf_counter() - t_last
                record = {"step": done, "loss": loss, "grad_norm": float(m["grad_norm"]),
                          "heldout_loss": evaluate(state.params, cfg, eval_batches),
                          "tokens": done * tc.batch_size * tc.seq_len, "time": time.time(),
                          "train_tok_s": (done - max(start, done - tc.eval_every)) * tc.batch_size * tc.seq_len
                          / seconds}
                bar.set_postfix(loss=f"{loss:.3f}", heldout=f"{record['heldout_loss']:.3f}")
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                t_last = time.perf_counter()
            if done % tc.save_every == 0 or done == end:
                manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    plot_loss(metrics_path, os.path.join(workdir, "loss.png"), title=name)
    return state.params


def _truncate_metrics(path: str, step: int) -> None:
    """Drop records past the checkpoint we resume from (they will be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(keep)


def plot_loss(metrics_paths, out: str, title: str = "", labels: list[str] | None = None) -> None:
    """Loss curves (train and held-out) against training tokens. Each entry of `metrics_paths` is one model: a
    metrics.jsonl path, or a list of them for consecutive training phases (drawn as one curve, tokens accumulated,
    with a dotted line where each later phase starts)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    entries = [metrics_paths] if isinstance(metrics_paths, str) else metrics_paths
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, entry in enumerate(entries):
        phases = [entry] if isinstance(entry, str) else list(entry)
        tokens, train_loss, heldout, starts, offset = [], [], [], [], 0
        for path in phases:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            if not rows:
                continue
            if tokens:
                starts.append(offset / 1e6)
            tokens += [(offset + r["tokens"]) / 1e6 for r in rows]
            train_loss += [r["loss"] for r in rows]
            heldout += [r["heldout_loss"] for r in rows]
            offset += rows[-1]["tokens"]
        if not tokens:
            continue
        label = labels[i] if labels else os.path.basename(os.path.dirname(phases[0]))
        line, = ax.plot(tokens, train_loss, alpha=0.5, label=f"{label} train")
        ax.plot(tokens, heldout, color=line.get_color(), label=f"{label} held-out")
        for x in starts:
            ax.axvline(x, color=line.get_color(), linestyle=":", alpha=0.7)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
