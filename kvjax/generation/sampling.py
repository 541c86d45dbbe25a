"""How the next token is picked: greedy, or sampled after temperature and top_p. One definition of the
distribution, shared by plain generation, the speculative verify loop and every drafter, so that lossless
speculative sampling reproduces exactly what kvjax.generate samples from."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token. temperature 0 is greedy (argmax); otherwise softmax(logits / T) restricted to
    the smallest set of tokens whose probability reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens int32 [B] from logits [B, V]."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        sorted_logits = jnp.where(before < sampling.top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)



def sample_rows(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, keys: jax.Array) -> jax.Array:
    """`sample` with each row's own settings and key: logits [B, V], temperature, top_p and keys [B] (arrays, so
    rows of one batch may differ: a server's requests, each sampling the same tokens whatever shares its batch).
    Next tokens int32 [B]; a row's temperature must be > 0 (a greedy row's result is unused: take the argmax)."""
    x = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens, as `sample`
    sorted_x = jnp.where(before < top_p[:, None], sorted_x, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, sorted_x)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

def sampling_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution `sample` draws from, as probabilities [..., V] f32: softmax(logits / T), restricted to the
    smallest set of most likely tokens whose mass reaches top_p (a token is kept when the mass of strictly more
    likely tokens is below top_p, as `sample` does) and renormalised. Needs temperature > 0."""
    probs = jax.nn.softmax(logits.astype(jnp.float32) / sampling.temperature, axis=-1)
    return probs if sampling.top_p >= 1.0 else _top_p(probs, sampling.top_p)


def row_sampling_probs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """`sampling_probs` with each row's own settings: logits [B, ..., V], temperature and top_p [B] (arrays, so rows
    of one batch may differ: a server's requests). A row's temperature must be > 0 (a greedy row's result is
    unused: pass any positive value there)."""
    shape = (-1,) + (1,) * (logits.ndim - 1)  # [B] -> broadcast over the row's positions and the vocabulary
    t = jnp.asarray(temperature, jnp.float32).reshape(shape)
    probs = jax.nn.softmax(logits.astype(jnp.float32) / t, axis=-1)
    return _top_p(probs, jnp.asarray(top_p, jnp.float32).reshape(shape))


def _top_p(probs: jax.Array, top_p) -> jax.Array:
    """probs [..., V] restricted to the most likely tokens whose mass reaches top_p (broadcastable to probs[..., :1])
    and renormalised."""
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    keep = jnp.zeros_like(keep_sorted)
    keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
    probs = jnp.where(keep, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    """Tokens int32 [...] drawn from probabilities [..., V] (zeros are never drawn)."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
