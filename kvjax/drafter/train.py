"""Training the block drafter on the verifier's own outputs (what it must predict for speculative decoding).

Data (cached on disk in the work directory, each stage resumable):
  1. sequences: prompts (corpus windows of varied length) and the verifier's own continuations of them
     (kvjax.generate in batches; greedy, and for a `sampled_frac` share of the batches sampled at `temperature`, as
     DFlash trains on the target's generated responses: sampled text shows the drafter the verifier's less likely
     but still plausible paths, which greedy data never visits): tokens int32 [N, S] = prompt + continuation,
     right-padded, with prompt_len [N] and valid_len [N] (prompt + continuation up to and including its first EOS);
  2. features: the verifier's outputs of the drafter's feature layers at every position, float16 [N, S, F]
     (computed once: the verifier is frozen, so re-running it every step would only repeat this work);
  3. the draft vocabulary: the `draft_vocab` most frequent tokens of the continuations.
Training (optax AdamW, warmup + cosine, clipping; orbax checkpoints every `save_every` steps; batches a pure function
of (seed, step), so a resumed run is the uninterrupted one): each step takes `batch_size` sequences and
`blocks_per_seq` random anchors in each continuation; every block gets a block size drawn from the trained sizes
(one drafter serves them all) and, with probability `known_prob`, a true prefix given as input (refinement
training). Loss: cross-entropy over the draft vocabulary, position j of a block weighted exp(-(j-1)/decay)
(the early positions decide the acceptance length). Held-out greedy sequences give the held-out loss and the expected
acceptance length tau = 1 + mean length of the exactly-predicted prefix of full-size blocks.
Progress bar, metrics.jsonl and loss.png in the work directory.
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
from kvjax.drafter.config import DrafterConfig
from kvjax.drafter.model import DrafterParams, draft_head, init_drafter, target_features, train_logits, with_vocab
from kvjax.generation import generate
from kvjax.pretrain import TrainState, plot_loss

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 1500
    batch_size: int = 8  # sequences per step
    blocks_per_seq: int = 16  # anchors per sequence per step
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    decay: float = 7.0  # loss weight of block position j: exp(-(j - 1) / decay) (DFlash's gamma for b = 16)
    known_prob: float = 0.2  # share of blocks trained with a known true prefix (for `refine`)
    init_from_target: bool = True  # drafter layers start as copies of the verifier's last layers
    seed: int = 0
    save_every: int = 100
    eval_every: int = 50
    eval_seqs: int = 64  # sequences held out of training (the last ones)


# ---- data -----------------------------------------------------------------------------------------------------------

def sampled_batch(index: int, sampled_frac: float) -> bool:
    """Whether continuation batch `index` is sampled: evenly spread, so any prefix of the batches (a run stopped
    early) has the same share."""
    return int((index + 1) * sampled_frac) > int(index * sampled_frac)


def make_sequences(model, prompts: np.ndarray, prompt_len: np.ndarray, gen_len: int, batch: int, work: str,
                   eos: int, *, sampled_frac: float = 0.0, temperature: float = 0.8, seed: int = 0) -> dict:
    """The verifier's continuations of prompts int32 [N, P] (right-padded to prompt_len [N]): greedy, or sampled at
    `temperature` for a `sampled_frac` share of the batches (key: (seed, batch index)). Cached in
    `work`/sequences.npz; batches already generated are kept in `work`/gen/ (an interrupted run resumes)."""
    out = os.path.join(work, "sequences.npz")
    if os.path.isfile(out):
        return dict(np.load(out))
    cfg, params = model
    os.makedirs(os.path.join(work, "gen"), exist_ok=True)
    n = len(prompts)
    gens = []
    for lo in tqdm(range(0, n, batch), desc="verifier continuations", unit="batch"):
        part = os.path.join(work, "gen", f"{lo:06d}.npy")
        if not os.path.isfile(part):
            hi = min(lo + batch, n)
            rows = np.arange(lo, lo + batch) % n  # a full last batch: one compiled shape
            sample = sampled_batch(lo // batch, sampled_frac)
            g = np.asarray(generate(params, cfg, prompts[rows], gen_len, prompt_lengths=prompt_len[rows],
                                    temperature=temperature if sample else 0.0,
                                    key=jax.random.key(seed * 1_000_003 + lo) if sample else None,
                                    eos_token_ids=(eos,), pad_token_id=eos))[: hi - lo]
            np.save(part + ".tmp.npy", g)
            os.replace(part + ".tmp.npy", part)
        gens.append(np.load(part))
    gen = np.concatenate(gens)
    sampled = np.repeat([sampled_batch(i, sampled_frac) for i in range(-(-n // batch))], batch)[:n]
    s = prompts.shape[1] + gen_len
    tokens = np.full((n, s), eos, np.int32)
    for i in range(n):
        tokens[i, : prompt_len[i]] = prompts[i, : prompt_len[i]]
        tokens[i, prompt_len[i]: prompt_len[i] + gen_len] = gen[i]
    first_eos = np.where((gen == eos).any(1), (gen == eos).argmax(1) + 1, gen_len)
    data = {"tokens": tokens, "prompt_len": prompt_len.astype(np.int32),
            "valid_len": (prompt_len + first_eos).astype(np.int32), "sampled": sampled}
    np.savez(out + ".tmp.npz", **data)
    os.replace(out + ".tmp.npz", out)
    return data


def make_features(model, tokens: np.ndarray, feature_layers: tuple[int, ...], batch: int, work: str) -> np.ndarray:
    """float16 [N, S, F] memory map of the verifier's features (`work`/features.npy; `work`/features.done counts
    the rows written, so an interrupted run continues where it stopped)."""
    cfg, params = model
    path, done_path = os.path.join(work, "features.npy"), os.path.join(work, "features.done")
    n, s = tokens.shape
    f = len(feature_layers) * cfg.hidden_size
    done = int(open(done_path).read()) if os.path.isfile(done_path) else 0
    if done >= n:
        return np.load(path, mmap_mode="r")
    feats = (np.lib.format.open_memmap(path, mode="r+") if done else
             np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, s, f)))
    fn = aot.jit(target_features, static_argnums=(1, 3))
    for lo in tqdm(range(done, n, batch), desc="verifier features", unit="batch", initial=done // batch,
                   total=-(-n // batch)):
        rows = np.arange(lo, lo + batch) % n
        feats[lo: min(lo + batch, n)] = np.asarray(fn(params, cfg, tokens[rows], feature_layers),
                                                   np.float16)[: min(batch, n - lo)]
        feats.flush()
        with open(done_path, "w") as fh:
            fh.write(str(min(lo + batch, n)))
    return np.load(path, mmap_mode="r")


def draft_vocabulary(tokens: np.ndarray, prompt_len: np.ndarray, valid_len: np.ndarray, size: int,
                     vocab_size: int) -> np.ndarray | None:
    """The `size` most frequent tokens of the continuations (sorted ids), or None for the whole vocabulary."""
    if not size or size >= vocab_size:
        return None
    counts = np.zeros(vocab_size, np.int64)
    for row, p, v in zip(tokens, prompt_len, valid_len):
        counts += np.bincount(row[p:v], minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


# ---- batches --------------------------------------------------------------------------------------------------------

def batch_at(data: dict, feats: np.ndarray, rows_pool: np.ndarray, dcfg: DrafterConfig, tc: DrafterTrainConfig,
             step: int, seed: int, vocab_index: np.ndarray, eval_mode: bool = False) -> dict:
    """One training (or, with eval_mode, held-out: full-size blocks, nothing known) batch; pure in (seed, step)."""
    rng = np.random.default_rng([seed, step])
    block, k = dcfg.max_block, tc.blocks_per_seq
    rows = np.sort(rng.choice(rows_pool, tc.batch_size, replace=False))
    tokens, p, v = data["tokens"][rows], data["prompt_len"][rows], data["valid_len"][rows]
    # anchors: the position of each block's `last` token, from the prompt's last token (the first block of a
    # generation: the loop's first pending token) on, with at least one continuation token after it
    anchors = (p[:, None] - 1 + (rng.random((len(rows), k)) * (v - p)[:, None]).astype(np.int64)).astype(np.int32)
    if eval_mode:
        sizes = np.full((len(rows), k), block, np.int32)
        known = np.zeros((len(rows), k), np.int32)
    else:
        sizes = rng.choice(np.asarray(dcfg.block_sizes, np.int32), (len(rows), k))
        known = np.where(rng.random((len(rows), k)) < tc.known_prob,
                         (rng.random((len(rows), k)) * (sizes - 1)).astype(np.int32) + 1, 0).astype(np.int32)
    j = np.arange(1, block + 1)
    pos = anchors[..., None] + j  # [B, K, block]
    labels = np.take_along_axis(tokens[:, None, :], np.minimum(pos, tokens.shape[1] - 1), axis=2)
    index = vocab_index[labels]  # -1: not in the draft vocabulary
    live = (j <= sizes[..., None]) & (pos < v[:, None, None]) & (j > known[..., None])
    weight = np.exp(-(j - 1) / tc.decay) * live * (index >= 0)
    return {"features": np.asarray(feats[rows]), "tokens": tokens, "anchors": anchors, "sizes": sizes,
            "known": known, "labels": np.maximum(index, 0).astype(np.int32), "weight": weight.astype(np.float32),
            "live": live & (index >= 0)}


def make_optimizer(tc: DrafterTrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, max(tc.steps, tc.warmup_steps + 1),
                                                  end_value=tc.lr * tc.min_lr_ratio)
    mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731  (no decay on norms/mask)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay, mask=mask))


def block_loss(dp: DrafterParams, dcfg: DrafterConfig, tparams, head, batch: dict):
    """(weighted CE, metrics) of one batch."""
    logits = train_logits(dp, dcfg, tparams, batch["features"].astype(jnp.float32), batch["tokens"],
                          batch["anchors"], batch["sizes"], dcfg.max_block, head, batch["known"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    loss = jnp.sum(ce * batch["weight"]) / jnp.maximum(jnp.sum(batch["weight"]), 1e-6)
    right = (jnp.argmax(logits, -1) == batch["labels"]) & batch["live"]
    # acceptance length of a block: 1 (the verifier's own token) + the exactly drafted prefix
    accepted = 1 + jnp.sum(jnp.cumprod(right, axis=-1), axis=-1)
    acc1 = jnp.sum(right[..., 0]) / jnp.maximum(jnp.sum(batch["live"][..., 0]), 1)
    # tau: the mean over blocks; inv_tau: the mean of 1 / length. The verify loop's tau (tokens per round) is the
    # harmonic mean, 1 / mean(inv_tau): each round starts where the last one stopped, so hard stretches get more
    # rounds than a uniform anchor does (measured on the shipped drafter: anchors' mean 2.09, the loop 1.56, on
    # the same held-out sequences)
    return loss, {"tau": jnp.mean(accepted), "inv_tau": jnp.mean(1.0 / accepted), "acc1": acc1}


def _truncate_metrics(path: str, step: int) -> None:
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(keep)


def train_drafter(model, dcfg: DrafterConfig, tc: DrafterTrainConfig, data: dict, feats: np.ndarray,
                  vocab_ids: np.ndarray | None, work: str, stop_at: int | None = None,
                  init: DrafterParams | None = None) -> DrafterParams:
    """Train (or resume) the drafter in `work`/train; returns its params (without the vocabulary). `init` (a trained
    drafter's params of the same config) continues training from it with a fresh schedule, instead of starting from
    the verifier's layers."""
    tcfg, tparams = model
    dcfg.check_target(tcfg)
    wdir = os.path.join(work, "train")
    os.makedirs(wdir, exist_ok=True)
    with open(os.path.join(wdir, "train_config.json"), "w") as f:
        json.dump({"drafter": dcfg.to_dict(), "train": dataclasses.asdict(tc)}, f, indent=2)
    vocab_index = np.full(tcfg.vocab_size, -1, np.int64)
    ids = np.arange(tcfg.vocab_size) if vocab_ids is None else np.asarray(vocab_ids)
    vocab_index[ids] = np.arange(len(ids))
    head = draft_head(tparams, None if vocab_ids is None else jnp.asarray(vocab_ids))
    usable = data["valid_len"] - data["prompt_len"] >= 2
    # held out: the last greedy sequences (the verify loop's tau is that of greedy text; sampled text would
    # understate it); everything else trains
    greedy = usable & ~data.get("sampled", np.zeros_like(usable))
    eval_rows = np.flatnonzero(greedy)[-tc.eval_seqs:]
    train_rows = np.setdiff1d(np.flatnonzero(usable), eval_rows)

    opt = make_optimizer(tc)
    if init is not None:
        params = with_vocab(init, None)
    else:
        params = init_drafter(dcfg, jax.random.key(tc.seed), target_params=tparams if tc.init_from_target else None)
    state = TrainState(params, opt.init(params), jnp.zeros((), jnp.int32))
    manager = checkpointing.manager(os.path.join(wdir, "ckpt"))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
        log.info("drafter: resumed from step %d", start)

    @aot.jit
    def step_fn(state, batch):
        (loss, m), grads = jax.value_and_grad(block_loss, has_aux=True)(state.params, dcfg, tparams, head, batch)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), {"loss": loss, **m}

    eval_fn = aot.jit(lambda p, b: block_loss(p, dcfg, tparams, head, b))
    eval_batches = [batch_at(data, feats, eval_rows, dcfg, tc, i, 10_000 + tc.seed, vocab_index, eval_mode=True)
                    for i in range(max(1, len(eval_rows) // tc.batch_size))]
    metrics_path = os.path.join(wdir, "metrics.jsonl")
    _truncate_metrics(metrics_path, start)
    end = min(tc.steps, stop_at or tc.steps)
    bar = tqdm(range(start, end), initial=start, total=tc.steps, desc="train drafter", unit="step",
               dynamic_ncols=True)
    tokens_per_step = tc.batch_size * tc.blocks_per_seq * dcfg.max_block
    t_last = time.perf_counter()
    with open(metrics_path, "a") as mf:
        for step in bar:
            state, m = step_fn(state, batch_at(data, feats, train_rows, dcfg, tc, step, tc.seed, vocab_index))
            loss = float(m["loss"])
            done = step + 1
            if done % tc.eval_every == 0 or done == end:
                ev = [eval_fn(state.params, b) for b in eval_batches]
                rec = {"step": done, "loss": loss, "tau_train": float(m["tau"]),
                       "heldout_loss": float(np.mean([float(e[0]) for e in ev])),
                       "heldout_tau": float(np.mean([float(e[1]["tau"]) for e in ev])),
                       "heldout_tau_loop": float(1 / np.mean([float(e[1]["inv_tau"]) for e in ev])),
                       "heldout_acc1": float(np.mean([float(e[1]["acc1"]) for e in ev])),
                       "tokens": done * tokens_per_step, "time": time.time(),
                       "step_s": (time.perf_counter() - t_last) / max(1, done - max(start, done - tc.eval_every))}
                bar.set_postfix(loss=f"{loss:.3f}", heldout=f"{rec['heldout_loss']:.3f}",
                                tau=f"{rec['heldout_tau_loop']:.2f}")
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                t_last = time.perf_counter()
            if done % tc.save_every == 0 or done == end:
                manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    plot_loss(metrics_path, os.path.join(wdir, "loss.png"), title="block drafter (weighted CE over the draft vocab)",
              labels=["drafter"])
    plot_tau(metrics_path, os.path.join(wdir, "tau.png"), dcfg.max_block)
    return state.params


def plot_tau(metrics_path: str, out: str, block: int) -> None:
    """Held-out acceptance length and first-token accuracy against training tokens: where the curve flattens is
    where more training of this recipe stops paying."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return
    tokens = [r["tokens"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, [r["heldout_tau"] for r in rows], color="tab:blue", alpha=0.4, linestyle="--",
            label=f"held-out tau, mean over anchors (b = {block})")
    if "heldout_tau_loop" in rows[0]:
        ax.plot(tokens, [r["heldout_tau_loop"] for r in rows], color="tab:blue",
                label="held-out tau, as the verify loop counts it")
    ax.set_xlabel("training tokens (M block positions)")
    ax.set_ylabel("acceptance length tau")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(tokens, [r["heldout_acc1"] for r in rows], color="tab:orange", alpha=0.7, label="first-token accuracy")
    ax2.set_ylabel("first-token accuracy")
    ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right")
    ax.set_title("block drafter: held-out acceptance against training")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
