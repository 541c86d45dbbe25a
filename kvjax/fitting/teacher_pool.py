"""The residual's training windows with everything the frozen models say about them computed once (a pool).

The residual trainer (kvjax.fitting.residual) spends most of a step in the two frozen models: the teacher's pass over
the whole window and the source's prefill of the prefix (on the toy pair ~75% of the FLOPs of a step; the target
reading the mapped cache, forward and backward, is the rest). Neither depends on the map, so with
`ResidualConfig.pool_windows = N` the trainer draws N windows once, runs the source once per window (one pass gives
its prefix cache and, when it is the teacher, its final hidden states), keeps them in host memory, and each step
reads a batch of them: only the map and the student run per step. The loss is exactly the streaming trainer's on the
same windows: the teacher's logits are recomputed per step from its final hidden states (unembedding ~ the student's
own LM head; the stored [N, cont, D] is 1/32 of the logits on the toy vocabulary) instead of stored or truncated to a
top-k.

The price is fewer distinct windows (N instead of steps x batch): each epoch visits every window once in a seeded
order, so a resumed run draws the batches it would have drawn. Rollout training (`rollout`) makes its continuation
from the current map each step, so it cannot use a pool; nor can a multi-process run (each process would need
its own rows of the pool). On one process with several devices the pooled step runs where the models and the map are
placed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import aot
from kvjax.cache import KVCache
from kvjax.models.decoder import prefill_forward, rms_norm, unembed
from kvjax.models.model import Model
from kvjax.windows import sample


@dataclasses.dataclass(frozen=True)
class Pool:
    """N windows with the frozen models' outputs (host arrays)."""

    tokens: np.ndarray  # int32 [N, prefix + cont]
    k: np.ndarray  # [L_src, N, Hkv, prefix - 1, hd] the source's cache of each window's first prefix - 1 tokens
    v: np.ndarray
    hidden: np.ndarray  # [N, cont, D] the teacher's last-layer output (before its final norm) at the scored positions

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """Pool rows of training step `step`: epoch after epoch, each a permutation of (seed, epoch)."""
        n = len(self)
        first = step * batch_size
        idx = [np.random.default_rng([seed, 7919, e]).permutation(n)[j]
               for e, j in (divmod(p, n) for p in range(first, first + batch_size))]
        return np.asarray(idx)

    def batch(self, step: int, batch_size: int, seed: int):
        """(tokens [B, W], source cache of the prefixes, teacher hidden states [B, cont, D]) of step `step`."""
        r = self.rows(step, batch_size, seed)
        cache = KVCache.from_stacked(jnp.asarray(self.k[:, r]), jnp.asarray(self.v[:, r]),
                                     jnp.full((len(r),), self.k.shape[3], jnp.int32))
        return jnp.asarray(self.tokens[r]), cache, jnp.asarray(self.hidden[r])


@functools.partial(aot.jit, static_argnames=("scfg", "tcfg", "prefix", "teacher"))
def _pool_batch(sparams, tparams, scfg, tcfg, tokens, prefix: int, teacher: str):
    """One batch of windows: the source's prefix cache and the teacher's last-layer output on the continuation. With
    the source as teacher one pass gives both (causal: its cache of the first prefix - 1 positions is the prefix's)."""
    inputs = tokens[:, :-1]
    model_params, model_cfg = (sparams, scfg) if teacher == "source" else (tparams, tcfg)
    _, cache, h, _ = prefill_forward(model_params, model_cfg, inputs, logits=None,
                                     features=(model_cfg.num_layers - 1,))
    if teacher != "source":
        cache = prefill_forward(sparams, scfg, inputs[:, : prefix - 1], logits=None).cache
    return cache.k[:, :, :, : prefix - 1], cache.v[:, :, :, : prefix - 1], h[:, prefix - 1 :]


def build_pool(source: Model, target: Model, tokens: np.ndarray, n: int, prefix: int, cont: int, seed: int,
               teacher: str = "source", batch_size: int = 8) -> Pool:
    """`n` windows of prefix + cont tokens sampled from a flat token array (seeded) with the frozen models' outputs."""
    windows = sample(tokens, n, prefix + cont, seed=seed + 7919)
    return pool_of(source, target, windows, prefix, teacher, batch_size)


def pool_of(source: Model, target: Model, windows: np.ndarray, prefix: int, teacher: str = "source",
            batch_size: int = 8) -> Pool:
    """The Pool of given windows int32 [N, prefix + cont] (e.g. kvjax.fitting.copy_windows' fact-copy windows)."""
    (scfg, sparams), (tcfg, tparams) = source, target
    n = len(windows)
    ks, vs, hs = [], [], []
    for i in tqdm(range(0, n, batch_size), desc="teacher pool", unit="batch", leave=False):
        chunk = windows[i : i + batch_size]
        real = len(chunk)
        if real < batch_size:  # one shape: one compile
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, 0)])
        k, v, h = _pool_batch(sparams, tparams, scfg, tcfg, jnp.asarray(chunk), prefix, teacher)
        ks.append(np.asarray(k)[:, :real])
        vs.append(np.asarray(v)[:, :real])
        hs.append(np.asarray(h)[:real])
    return Pool(windows, np.concatenate(ks, 1), np.concatenate(vs, 1), np.concatenate(hs))


def teacher_logits(teacher: Model, hidden: jax.Array) -> jax.Array:
    """The teacher's logits from its stored last-layer output (as its forward pass computes them; traceable)."""
    cfg, params = teacher
    return unembed(params, rms_norm(hidden, params.final_norm, cfg.rms_norm_eps))
