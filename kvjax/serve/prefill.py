"""A prefill batch read in pieces: after a cached prefix (kvjax.serve.prefix), and in chunks between decode steps.

The engine's plain prefill (kvjax.serve.programs.prefill_batch) reads each prompt whole. A `PrefillJob` reads the
same prompts through the builder's resumable interface (kvjax.builders.base.Resumable): each row starts from its
longest cached prefix (its blocks written into the state), then reads the rest in pieces of `width` tokens; when it
is done, `finish` stores the new full blocks and hands back the answering model's cache, laid out as
`prefill_batch`'s (rows padded to a power of two, positions to a prefill bucket), so the slots insert it the same way.

Widths. With no cached prefix and no chunking a job is one piece over the prompt's bucket (as `prefill_batch`); after
a cached prefix the rest is read in pieces of 64 or 256 tokens (a few programs per prefill bucket, whatever the
prefix length), each piece the widest that pads fewer than 64 positions: a piece costs about its width in tokens
whether they are real or padding (a rest of 95 tokens, a conversation's first turn after the shared system prompt,
costs 14 ms a prompt in two 64-token pieces against 22 ms in one of 256, toy pair, batch 4). Chunked prefill reads
pieces of the per-step budget split over the batch's rows. Every piece is one call of the builder's `resume`, so the
decode thread can run a step between two pieces.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from kvjax import aot
from kvjax.builders.base import Resumable
from kvjax.cache import KVCache, window_sizes
from kvjax.serve import programs
from kvjax.serve.placement import replicated_like
from kvjax.serve.prefix import PrefixCache

WIDTHS = (64, 256)  # pieces after a cached prefix


@functools.partial(aot.jit, static_argnums=(0, 1, 2))
def _start(builder, batch: int, capacity: int):
    """builder.start as one compiled call (its dozens of zero buffers are one dispatch, not one each)."""
    return builder.start(batch, capacity)


@functools.lru_cache(maxsize=64)
def _layout(builder, batch: int, capacity: int):
    """The state's shapes, dtypes and metadata, allocating nothing."""
    return jax.eval_shape(functools.partial(builder.start, batch, capacity))


def chunk_width(max_step_tokens: int, batch: int) -> int:
    """Tokens per row of one chunked-prefill piece: the per-step budget over the padded batch, a multiple of 16."""
    return max(16, max_step_tokens // batch // 16 * 16)


class PrefillJob:
    """`builder` (Resumable) reads `prompts` (token ids; every prompt's last token is decoded, not prefilled, as in
    `prefill_batch`) padded to `batch` rows; `buckets`: the engine's prefill buckets; `prefix`: the prefix cache or
    None; `chunk`: tokens per row per piece (0: not chunked). Call `step()` until it returns True, then `finish()`;
    `close()` (always, also on failure) releases the cached blocks it pinned."""

    def __init__(self, builder, prompts: list[list[int]], buckets: tuple[int, ...], batch: int,
                 prefix: PrefixCache | None = None, chunk: int = 0):
        if not isinstance(builder, Resumable):
            raise TypeError(f"{builder!r} cannot read a prompt in pieces (not a kvjax.builders.base.Resumable)")
        self.builder, self.prefix = builder, prefix
        self.prompts = [list(p[:-1]) for p in prompts]
        self.chains = [prefix.match(p) if prefix is not None else [] for p in self.prompts]
        pad = batch - len(prompts)
        block = prefix.block if prefix is not None else 0
        self.end = np.array([len(p) for p in self.prompts] + [1] * pad, np.int32)  # padding rows: one token
        self.offset = np.array([len(c) * block for c in self.chains] + [0] * pad, np.int32)
        self.reused = int(self.offset.sum())
        self.capacity = programs.bucket_for(int(self.end.max()), buckets)
        self.fresh = not self.offset.any()
        self.state = _start(builder, batch, self.capacity) if self.fresh else self._filled(batch)
        self.chunk = chunk
        self.width = min(chunk, self.capacity) if chunk else self.capacity if self.fresh else self._rest_width()
        self.computed = 0

    def _rest_width(self) -> int:
        """The next piece's width after a cached prefix: the widest of WIDTHS that pads fewer than WIDTHS[0]
        positions of the longest remaining row, else the narrowest (a prompt read whole from the cache has no rest)."""
        remaining = int((self.end - self.offset).max())
        return min(max((w for w in WIDTHS if w - remaining < WIDTHS[0]), default=WIDTHS[0]), self.capacity)

    @property
    def done(self) -> bool:
        return bool((self.offset >= self.end).all())

    def _filled(self, batch: int) -> tuple[KVCache, ...]:
        """A state holding each row's cached blocks (written on the host, then moved in one transfer)."""
        state = _layout(self.builder, batch, self.capacity)
        host = [([np.zeros(a.shape, a.dtype) for a in c.keys], [np.zeros(a.shape, a.dtype) for a in c.values])
                for c in state]
        for row, chain in enumerate(self.chains):
            if chain:
                PrefixCache.fill(host, row, chain)
        # placed where the builder's weights are, as a compiled call's outputs are: the same programs serve both
        where = replicated_like(jax.tree.leaves(self.builder.model[1])[0].sharding)
        host, lengths = jax.device_put((host, self.offset), where)
        return tuple(c.replace(keys=tuple(keys), values=tuple(values), lengths=lengths)
                     for c, (keys, values) in zip(state, host))

    def step(self) -> bool:
        """Read the next piece; True when every row has read its prompt."""
        if self.done:
            return True
        if not self.fresh and not self.chunk:
            self.width = self._rest_width()
        n = np.minimum(self.end - self.offset, self.width).astype(np.int32)
        tokens = np.zeros((len(self.end), self.width), np.int32)
        for i, p in enumerate(self.prompts):
            tokens[i, :n[i]] = p[self.offset[i]:self.offset[i] + n[i]]
        self.state = self.builder.resume(self.state, tokens, n, fresh=self.fresh)
        self.fresh = False
        self.offset = self.offset + n
        self.computed += int(n[:len(self.prompts)].sum())
        return self.done

    def finish(self) -> KVCache:
        """The answering model's cache of every prompt; the prompts' new full blocks go into the prefix cache."""
        while not self.step():
            pass
        answer = self.state[-1]
        if self.prefix is not None and any(len(p) // self.prefix.block > len(c)
                                           for p, c in zip(self.prompts, self.chains)):
            host = jax.device_get([(list(c.keys), list(c.values)) for c in self.state])
            for row, p in enumerate(self.prompts):
                self.chains[row] = self.prefix.store(p, self.chains[row], host, row)
        return answer

    def close(self) -> None:
        if self.prefix is not None:
            for chain in self.chains:
                self.prefix.release(chain)
            self.chains = [[] for _ in self.chains]


def pieces(capacity: int, batch: int, prefix: bool, max_step_tokens: int) -> set[tuple[int, bool]]:
    """The (width, fresh) pieces a PrefillJob of batch x capacity may run: what warm-up compiles."""
    out = {(capacity, True)}  # nothing cached, not chunked: the whole prompt at once
    if prefix:
        out |= {(min(w, capacity), False) for w in WIDTHS}
    if max_step_tokens:
        w = min(chunk_width(max_step_tokens, batch), capacity)
        out |= {(w, True), (w, False)}
    return out


def compile_pieces(builder, batch: int, capacity: int, widths) -> None:
    """Compile `builder.resume` for a state of batch x capacity and each (width, fresh) piece, and for a later piece
    of that width (warm-up; the results are dropped). A later piece is its own program: its state comes out of a
    compiled call, placed on the device, where a new one (`start`, or cached blocks) is not yet.

    A later piece is then run once after a prefix of each attention window's size (kvjax.cache.window_sizes: one
    lax.switch branch each): on XLA:CPU the first run of a branch costs 15-30 ms more than the next (toy source,
    batch 1, 16-token pieces), and a request whose prompt first reaches a window would otherwise pay it between two
    decode steps of every running request."""
    tokens = lambda width: np.zeros((batch, width), np.int32)  # noqa: E731
    ones = np.ones((batch,), np.int32)
    windowed = set()
    for width, fresh in sorted(widths):
        state = builder.resume(_start(builder, batch, capacity), tokens(width), ones, fresh=fresh)
        state = builder.resume(state, tokens(width), ones)
        if width not in windowed:  # once per width: a piece of n tokens after `start` cached positions attends over
            windowed.add(width)    # the smallest window holding start + n
            full = np.full((batch,), width, np.int32)
            for start in [w - width for w in window_sizes(capacity)[1:] if w > width]:
                state = tuple(c.replace(lengths=c.lengths * 0 + start) for c in state)  # placed as the state is
                state = builder.resume(state, tokens(width), full)
        jax.block_until_ready(state)
