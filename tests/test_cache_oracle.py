"""The held-out cache oracle (launch/research/cache_oracle.py --samples, docs/method.md): each prefix's cache is fitted
on continuations the source samples, never on the real continuation it is scored on."""

import jax.numpy as jnp
import numpy as np
import optax

from kvjax.models.decoder import forward_nocache
from launch.research import cache_oracle
from tests.maptools import VOCAB, native_cache, tiny_pair


def _room(cache, extra):
    """The cache with `extra` more positions of room (the oracle's caches hold the continuation too)."""
    pad = ((0, 0),) * 3 + ((0, extra),) + ((0, 0),)
    return cache.with_stacked(jnp.pad(cache.k, pad), jnp.pad(cache.v, pad))


def test_the_sampled_oracle_fits_sampled_continuations_only_and_scores_the_real_one():
    source, target = tiny_pair()
    (scfg, sparams), (tcfg, tparams) = source, target
    P, C = 12, 6
    rng = np.random.RandomState(0)
    w1 = rng.randint(1, VOCAB, (2, P + C)).astype(np.int32)
    w2 = w1.copy()
    w2[:, P:] = rng.randint(1, VOCAB, (2, C))  # the same prefixes, other real continuations
    runs = []
    for w in (jnp.asarray(w1), jnp.asarray(w2)):
        teacher = forward_nocache(sparams, scfg, w[:, :-1])[:, P - 1:]
        bases = [("own", _room(native_cache(tparams, tcfg, w[:, : P - 1]), C + 1))]
        runs.append(cache_oracle.sampled_oracle(w, source, target, bases, teacher, optax.adam(3e-2), prefix=P,
                                                cont=C, samples=3, steps=20, log=lambda m: None)["own"])
    a, b = runs
    np.testing.assert_allclose(a["fitted"], b["fitted"], rtol=1e-6)  # the fit never read the real continuation
    assert a["start"] != b["start"]  # which is what is scored
    assert a["fitted"][-1] < 0.8 * a["fitted"][0]  # and the cache does fit its samples
