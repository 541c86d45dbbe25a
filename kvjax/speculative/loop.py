"""The speculative verify loop: one compiled loop shared by every lossless drafter.

Each round a drafter proposes `draft_len` (gamma) tokens, the verifier scores the pending token and the gamma drafts in
ONE forward over its cache (the shared decoder forward with T = gamma + 1 at each row's own `lengths`), the longest
acceptable prefix is kept plus one token of the verifier's own, and both caches roll back to the accepted length by
setting `KVCache.lengths` (entries past `lengths` are dead: attention masks them and the next write overwrites them;
nothing is copied). Rows accept different lengths; a row stops at its first EOS (kept) or at max_new_tokens. The
whole loop is one `lax.while_loop` inside one jit, like kvjax.generate.

Acceptance. Greedy (temperature 0): a draft is accepted while it equals the verifier's argmax, and the verifier's
argmax after the accepted prefix is appended, so the output is the verifier's own greedy decode (token-identical up to
float rounding of a (gamma+1)-token forward vs one-token steps). Sampling: the standard rejection rule (Leviathan et
al. 2023; Chen et al. 2023): draft x ~ q is accepted with probability min(1, p(x)/q(x)); at the first rejection a token
is drawn from norm(max(0, p - q)); after gamma acceptances a bonus token is drawn from p. Both p (verifier) and q
(drafter) are the sampling distributions after temperature and top_p (`sampling_probs`), so the output is
distributed exactly as the verifier's own sampling with the same temperature/top_p.

State of a round. Every round starts with one PENDING token per row, `last` [B]: the newest output token, not yet in
the verifier's cache (at the start, the prompt's last token: the verifier's cache holds the prompt but its last
token). The verifier runs [last, d_1 .. d_gamma] at positions lengths .. lengths + gamma. With n_acc accepted drafts
its cache keeps lengths + n_acc + 1 positions (last and the accepted drafts), the round emits n_new = n_acc + 1
tokens (the accepted drafts and the verifier's token), and that last emitted token is the next pending token.

THE DRAFTER INTERFACE (what a drafting method implements; kvjax.speculative.draft.ModelDrafter is the plain one):

A drafter is a pytree, e.g. a flax.struct.dataclass: its arrays (weights) are leaves, its settings static fields. It is
passed into the compiled loop as an argument, so it must not hold Python state that changes. It has

    draft_len: int                      static gamma: drafts per round (DFlash: the block's mask positions)
    feature_layers: tuple[int, ...]     verifier layers whose hidden states it reads; () for a plain draft model.
                                        A feature is the OUTPUT of that verifier layer (residual stream after the
                                        layer's attention and MLP, before the final norm; HF hidden_states[i + 1]),
                                        the listed layers concatenated on the last axis: F = len(layers) * D_verifier
                                        (kvjax.models.decoder.forward's `features`).
    start(tokens [B, T] int32, lengths [B] int32, capacity: int, features [B, T, F] | None) -> state
        Host-level (may call jitted functions), once per batch, before the loop. tokens[:, :lengths] is each prompt
        WITHOUT its last token (that one is the first pending token); features are the verifier's at those positions
        (only when feature_layers is non-empty). `capacity`: cache positions the loop may write (prompt +
        max_new_tokens + gamma + 1); the state's caches need at least that many.
    propose(state, last [B] int32, key, sampling: Sampling) -> (drafts [B, gamma] int32, q, state)
        Traceable. `last` is the pending token. q: the drafter's sampling distribution of each draft, [B, gamma, V]
        f32 (`sampling_probs` of its logits), drafts drawn from it; None is allowed only when sampling.temperature
        is 0 (greedy drafts).
        Optional: `variable_length = True` (static attribute) lets a row stop drafting early: its drafts past the
        last real one are -1 (and its q there anything). The verify forward then runs only 1 + the longest real
        draft of the batch (lax.switch over gamma + 1 compiled lengths): on CPU a (t)-token verify costs more as t
        grows, so rounds where the drafter is unsure cost about one plain decode step.
    commit(state, tokens [B, gamma + 1] int32, n_new [B] int32, features [B, gamma + 1, F] | None) -> state
        Traceable. tokens[:, :n_new] are the tokens this round emitted: the n_new - 1 accepted drafts, then the
        verifier's token (which is the next pending token); entries past n_new are junk. features are the verifier's
        at the positions it ran this round, [last, d_1, .., d_gamma] (fewer when a round verified fewer: a server's
        round at a narrower width, kvjax.speculative.verify_block): the first n_new are now context (None when
        feature_layers is empty). n_new == 0 marks a row that had already finished: its state must come back as it
        was before this round's propose. Roll caches back by setting their `lengths` (no copies).
    counters(state) -> dict of arrays
        Optional, traceable. What the drafter counted over the run (the combined drafter: the rounds in which its
        model drafter ran); run_loop returns it as counters["drafter"], and Stats as `drafter`.
    advance(state, last [B] int32, tokens [B, 1] int32, n_new [B] int32, features [B, 1, F] | None) -> state
        Optional, traceable. The state after a round in which nothing was drafted: the verifier read `last` alone
        and emitted tokens[:, 0] where n_new is 1 (a plain decode step; n_new 0: a finished row, unchanged). What
        propose + commit would leave, without drafting. A server that turns drafting off for a step while keeping
        each request's drafter state current calls it (kvjax.serve); the lookup, block and combined drafters have
        it.

Entry points: `verify_round` (one round's drafting and verify pass, traceable) and `verify_block` (its verify pass
at a static width, a server's: kvjax.serve.programs), `verify_loop` (traceable), `run_loop` (the jitted loop from a
built verifier cache and drafter state), and kvjax.speculative.api (speculative_generate,
speculative_split_generate).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache, cache_jit
from kvjax.generation.sampling import Sampling, draw, row_sampling_probs, sampling_probs
from kvjax.models.decoder import forward, stack_kv, write_block


def accept_greedy(logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, g+1, V] of the verifier at [last, d_1..d_g], drafts [B, g] -> (n_acc [B], tokens [B, g+1]).

    The verifier's argmax at each position is what it would have emitted there; drafts are accepted while they
    equal it, so tokens = the argmax itself (its first n_acc entries ARE the accepted drafts, entry n_acc the
    verifier's own next token)."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    match = drafts == target[:, :-1]
    n_acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)
    return n_acc, target


def accept_sampled(logits: jax.Array, drafts: jax.Array, q: jax.Array, key: jax.Array, sampling: Sampling
                   ) -> tuple[jax.Array, jax.Array]:
    """The rejection rule: logits [B, g+1, V], drafts [B, g] drawn from q [B, g, V] -> (n_acc [B], tokens [B, g+1])
    with tokens[:, :n_acc] = the accepted drafts and tokens[:, n_acc] the corrected (or bonus) token."""
    ku, kr = jax.random.split(key)
    u = jax.random.uniform(ku, drafts.shape)
    return _reject(sampling_probs(logits, sampling), drafts, q, u, lambda probs: draw(probs, kr))


def accept_sampled_rows(logits: jax.Array, drafts: jax.Array, q: jax.Array, keys: jax.Array, temperature: jax.Array,
                        top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`accept_sampled` with each row's own temperature and top_p [B] (> 0: greedy rows take `accept_greedy`) and
    key [B] (a row's uniforms and corrected token come from its key alone, so they do not depend on the other
    rows of the batch): a server's batch of requests with different settings."""
    split = jax.vmap(jax.random.split)(keys)  # [B, 2]
    u = jax.vmap(lambda k: jax.random.uniform(k, drafts.shape[1:]))(split[:, 0])
    fix = lambda probs: jax.vmap(draw)(probs, split[:, 1])  # noqa: E731
    return _reject(row_sampling_probs(logits, temperature, top_p), drafts, q, u, fix)


def _reject(p: jax.Array, drafts: jax.Array, q: jax.Array, u: jax.Array, draw_fix) -> tuple[jax.Array, jax.Array]:
    """The rejection rule on the verifier's probabilities p [B, g+1, V] with uniforms u [B, g]; draw_fix(probs
    [B, V]) -> tokens [B] draws the corrected (or bonus) token."""
    b, g = drafts.shape
    real = drafts >= 0  # a variable-length drafter marks positions past its last draft with -1
    safe = jnp.where(real, drafts, 0)
    p_d = jnp.take_along_axis(p[:, :g], safe[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, safe[..., None], axis=-1)[..., 0]
    ok = real & (u * q_d < p_d)  # u < p/q without dividing; q_d > 0 for a drawn token
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
    rows = jnp.arange(b)
    p_n = p[rows, n_acc]  # [B, V]
    q_n = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n_acc]  # q = 0 after the last draft: bonus ~ p
    residual = jnp.maximum(p_n - q_n, 0.0)
    # p == q leaves no residual mass; rejection then had probability 0, reachable only through rounding: draw from p
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    fix = draw_fix(residual / jnp.sum(residual, -1, keepdims=True))
    drafts_ext = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    j = jnp.arange(g + 1)[None]
    tokens = jnp.where(j < n_acc[:, None], drafts_ext, fix[:, None])
    return n_acc, tokens


@dataclasses.dataclass(frozen=True)
class Stats:
    """Acceptance statistics of one speculative run, per row (numpy arrays).

    rounds [B]: verify rounds the row took part in; accepted [B]: drafts accepted over those rounds; per_round
    [B, R]: drafts accepted in each round (-1 where the row had stopped); emitted [B]: tokens in the output
    (EOS-truncated and capped at max_new_tokens, so the last round may have produced more than it kept); widths
    [draft_len + 2]: how many rounds ran a verify forward of t tokens, at index t (the batch's, not a row's: each
    round runs one forward; a fixed-length drafter's rounds are all at draft_len + 1); drafter: the drafter's own
    counters (the interface's optional `counters`), or None. The cost model (kvjax.speculative.cost) prices a run
    from them."""

    rounds: object
    accepted: object
    per_round: object
    emitted: object
    draft_len: int
    widths: object = None
    drafter: dict | None = None

    @property
    def acceptance_length(self):
        """Mean tokens per round per row, tau = (accepted + rounds) / rounds: accepted drafts plus the verifier's
        token (1 = nothing accepted, draft_len + 1 = everything)."""
        import numpy as np
        return (np.asarray(self.accepted) + np.asarray(self.rounds)) / np.maximum(np.asarray(self.rounds), 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Over all rounds of all rows: total (accepted + 1) / total rounds."""
        import numpy as np
        rounds = int(np.sum(self.rounds))
        return float((np.sum(self.accepted) + rounds) / max(rounds, 1))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / (rounds x draft_len), over all rows (a variable-length drafter that stopped early counts
        its undrafted positions as not accepted)."""
        import numpy as np
        return float(np.sum(self.accepted) / max(int(np.sum(self.rounds)) * self.draft_len, 1))

    def as_dict(self) -> dict:
        import numpy as np
        return {"draft_len": self.draft_len, "rounds": np.asarray(self.rounds).tolist(),
                "accepted": np.asarray(self.accepted).tolist(), "emitted": np.asarray(self.emitted).tolist(),
                "widths": None if self.widths is None else np.asarray(self.widths).tolist(),
                "drafter": None if self.drafter is None else {k: np.asarray(v).tolist()
                                                              for k, v in self.drafter.items()},
                "acceptance_length": self.acceptance_length.tolist(),
                "mean_acceptance_length": self.mean_acceptance_length, "acceptance_rate": self.acceptance_rate}


def verify_block(verifier, cache: KVCache, last: jax.Array, drafts: jax.Array, q, layers: tuple[int, ...] = (),
                 width: int | None = None):
    """The verify pass over [last, d_1 .. d_{width-1}] (traceable; `width` static, default g + 1), writing the block's
    keys/values into the cache as it goes (the decoder's forward: each layer writes, then attends over the cache;
    `lengths` come back as they were: the caller adds what was accepted). Drafts past width - 1 are cut; a -1 draft
    (nothing drafted there) stands in the block as id 0, and is never accepted. `last` [B] may have fewer rows than
    the cache: they are its first B rows (a server's occupied slots).

    Returns (drafts [B, width - 1], q [B, width - 1, V] (zero where nothing was drafted) or None, logits
    [B, width, V], cache, the verifier's features of `layers` at the block [B, width, F] or None).

    A server picks the width of each round from its drafts (the narrowest compiled width that holds the longest) and
    runs this at that static width: its decode cache is donated and updated in place, where a read-only verify pass
    followed by a separate block write (forward(write=False), write_block) made XLA:CPU copy the cache buffers (108
    copies in one program; 8 rows x 1,024 positions: 60 ms a round against 18 ms)."""
    vcfg, vparams = verifier
    width = drafts.shape[1] + 1 if width is None else int(width)
    drafts = drafts[:, :width - 1]
    drafted = jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=-1)  # [B, width - 1]: leading real drafts
    q = None if q is None else q[:, :width - 1] * drafted[..., None]  # nothing drafted there: q = 0, p rules
    block = jnp.concatenate([last[:, None], jnp.where(drafts >= 0, drafts, 0)], axis=1)
    out = forward(vparams, vcfg, block, cache, features=tuple(layers))
    return drafts, q, out.logits, out.cache.replace(lengths=cache.lengths), out.features


def verify_round(verifier, drafter, cache: KVCache, state, last: jax.Array, key: jax.Array, sampling: Sampling):
    """One round's drafting and verify pass (traceable): the drafter proposes from `state`, the verifier runs
    [last, d_1 .. d_gamma] over `cache` (a fixed-length drafter: `verify_block` at g + 1; a variable-length one: only
    as many tokens as the longest draft, lax.switch over the g + 1 widths, each a read-only pass, then one block
    write). Returns (drafts [B, g] (-1 past a variable-length drafter's real drafts), q [B, g, V] (zero past them) or
    None, logits [B, g+1, V], the cache with the block's keys/values written past each row's `lengths` (lengths as
    they were: the caller adds what was accepted), the verifier's features at the block [B, g+1, F] or None,
    verified (int32 scalar: tokens the forward ran), the state after propose)."""
    vcfg, vparams = verifier
    g = drafter.draft_len
    layers = tuple(drafter.feature_layers)
    drafts, q, state = drafter.propose(state, last, key, sampling)
    if not getattr(drafter, "variable_length", False):
        drafts, q, logits, cache, feats = verify_block(verifier, cache, last, drafts, q, layers)
        return drafts, q, logits, cache, feats, jnp.int32(g + 1), state

    def verify(t, block, cache):  # the verify forward over the first t tokens, padded back to g + 1 positions
        # reads the cache without writing it: a branch that wrote into the cache would make XLA:CPU copy the whole
        # cache into and out of the conditional (~0.3 ms a round on the toy source, a fifth of the verify pass);
        # reading it is free, and one write after the switch stores the block. The k/v of positions past t are
        # zeros, written past what the round can accept: dead, and overwritten before any later round reads them
        out = forward(vparams, vcfg, block[:, :t], cache, write=False, features=layers, tap=stack_kv)
        (k, v), logits, feats = out.tapped, out.logits, out.features
        pad = ((0, 0), (0, g + 1 - t), (0, 0))
        kv_pad = ((0, 0), (0, 0), (0, g + 1 - t), (0, 0), (0, 0))
        return (jnp.pad(logits, pad), jnp.pad(k, kv_pad), jnp.pad(v, kv_pad),
                None if feats is None else jnp.pad(feats, pad))

    drafted = jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=-1)  # [B, g]: leading real drafts
    # a -1 is never accepted, so any id may stand in for it in the block; nothing was drafted there: q = 0, p rules
    block = jnp.concatenate([last[:, None], jnp.where(drafts >= 0, drafts, 0)], axis=1)
    q = None if q is None else q * drafted[..., None]
    verified = jnp.max(jnp.sum(drafted, -1)) + 1  # tokens this round's forward runs
    logits, k, v, feats = jax.lax.switch(verified - 1, [functools.partial(verify, t) for t in range(1, g + 2)],
                                         block, cache)
    return drafts, q, logits, write_block(cache, k, v), feats, verified, state


def verify_loop(verifier, drafter, cache: KVCache, state, last: jax.Array, key: jax.Array, max_new_tokens: int,
                sampling: Sampling, eos_ids: tuple[int, ...], pad_id: int):
    """The speculative loop (traceable). verifier: a Model (cfg, params); cache: its KVCache holding each prompt but
    its last token; state: drafter.start's; last [B]: each prompt's last token. Returns (tokens int32 [B, N] with
    `pad_id` after each row's EOS or end, per-row counters (rounds, accepted, per_round, emitted), verifier cache,
    drafter state)."""
    b, g, n = last.shape[0], drafter.draft_len, max_new_tokens
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    greedy = sampling.temperature == 0.0
    width = n + g + 1  # room for a full round written at any count < n

    def write(row, toks, at):
        return jax.lax.dynamic_update_slice(row, toks, (at,))

    def cond(c):
        return (c["i"] < n) & ~jnp.all(c["done"])

    def body(c):
        key, kd, ka = jax.random.split(c["key"], 3)
        drafts, q, logits, cache, feats, verified, state = verify_round(verifier, drafter, c["cache"], c["state"],
                                                                        c["last"], kd, sampling)
        if greedy:
            n_acc, toks = accept_greedy(logits, drafts)
        elif q is None:
            raise ValueError(f"{type(drafter).__name__}.propose returned no draft distribution q; sampling "
                             "(temperature > 0) needs it for the rejection rule")
        else:
            n_acc, toks = accept_sampled(logits, drafts, q, ka, sampling)
        active = ~c["done"]
        n_new = jnp.where(active, n_acc + 1, 0)
        cache = cache.replace(lengths=cache.lengths + n_new)  # roll back: only last + accepted drafts stay
        state = drafter.commit(state, toks, n_new, feats)
        out = jnp.where(active[:, None], jax.vmap(write)(c["out"], toks, c["count"]), c["out"])
        is_eos = jnp.isin(toks, eos) & (jnp.arange(g + 1)[None] < n_new[:, None])
        hit = jnp.any(is_eos, axis=-1)
        kept = jnp.where(hit, jnp.argmax(is_eos, axis=-1) + 1, n_new)
        count = c["count"] + kept
        nxt = toks[jnp.arange(b), n_acc]
        return dict(i=c["i"] + 1, out=out, count=count, done=c["done"] | hit | (count >= n), cache=cache,
                    state=state, last=jnp.where(active, nxt, c["last"]), key=key,
                    rounds=c["rounds"] + active.astype(jnp.int32),
                    accepted=c["accepted"] + jnp.where(active, n_acc, 0),
                    per_round=c["per_round"].at[:, c["i"]].set(jnp.where(active, n_acc, -1)),
                    widths=c["widths"].at[verified].add(1))

    init = dict(i=jnp.int32(0), out=jnp.full((b, width), pad_id, jnp.int32), count=jnp.zeros((b,), jnp.int32),
                done=jnp.zeros((b,), bool), cache=cache, state=state, last=last.astype(jnp.int32), key=key,
                rounds=jnp.zeros((b,), jnp.int32), accepted=jnp.zeros((b,), jnp.int32),
                per_round=jnp.full((b, n), -1, jnp.int32), widths=jnp.zeros((g + 2,), jnp.int32))
    c = jax.lax.while_loop(cond, body, init)
    emitted = jnp.minimum(c["count"], n)
    out = jnp.where(jnp.arange(n)[None] < emitted[:, None], c["out"][:, :n], pad_id)
    counters = dict(rounds=c["rounds"], accepted=c["accepted"], per_round=c["per_round"], emitted=emitted,
                    widths=c["widths"])
    if hasattr(drafter, "counters"):
        counters["drafter"] = drafter.counters(c["state"])
    return out, counters, c["cache"], c["state"]


@functools.partial(cache_jit, static_argnames=("max_new_tokens", "sampling", "eos_ids", "pad_id"))
def _run_loop(verifier, drafter, cache, state, last, key, max_new_tokens, sampling, eos_ids, pad_id):
    out, counters, _, _ = verify_loop(verifier, drafter, cache, state, last, key, max_new_tokens, sampling, eos_ids,
                                      pad_id)
    return out, counters


def run_loop(verifier, drafter, cache: KVCache, state, last, key, max_new_tokens: int, sampling: Sampling,
             eos_ids: tuple[int, ...], pad_id: int):
    """The compiled `verify_loop`: (tokens int32 [B, N], counters dict of device arrays). The caller checks its
    inputs (kvjax.speculative.api does); one compile per (models, batch, capacity, N, sampling, EOS, pad)."""
    return _run_loop(verifier, drafter, cache, state, jnp.asarray(last, jnp.int32), key, int(max_new_tokens),
                     sampling, tuple(int(e) for e in eos_ids), int(pad_id))


def stats_of(counters: dict, draft_len: int) -> Stats:
    """Host Stats from run_loop's counters."""
    host = jax.device_get(counters)
    return Stats(rounds=host["rounds"], accepted=host["accepted"], per_round=host["per_round"],
                 emitted=host["emitted"], draft_len=draft_len, widths=host["widths"], drafter=host.get("drafter"))
