"""A prefix cache of transferred caches: prompts that share a prefix share its cache, across both models.

Real traffic repeats itself (a system prompt in every request, a chat that resends the whole conversation each
turn). A server that only decodes from its own prefill can reuse a prefix's cache of its own model; a transfer
server reuses more: a cached prefix skips the SOURCE's prefill and the map, not just the answerer's prefill.

What a block holds. Prompts are cut into blocks of `block` tokens; block i of a prompt is identified by its tokens
and the block before it (a trie over blocks: two prompts share block i only if they share every token up to its end,
so a block's cache is the same whoever computed it). A block keeps, for positions [i * block, (i + 1) * block), every
cache of the builder's state (kvjax.builders.base.Resumable): on the split path the answerer's mapped K/V AND the
source's own K/V. The source's half is needed because the source attends to the prefix when it reads the rest of the
prompt (its own keys and values, which the mapped cache cannot give back: the map goes one way) and a context map
reads the source's positions just before the rest; on the native-target path the state is the target's own cache.
Each position's cache depends only on the tokens up to it (causal attention; the map reads a position and the ones
before it), so a block computed in one prompt is exact for every prompt that starts with the same blocks.

Memory. Blocks live in host memory as numpy arrays (a hit writes them into the prefill's state and moves it to the
device; on an accelerator that is one host-to-device copy of the prefix, far cheaper than the source's prefill of
it). The decode slots hold each request's cache contiguously (no paging), so a hit is copied into the request's slot
and no running request references a block after its prefill; blocks are pinned (reference-counted) from the lookup
to the end of the prefill that reads or writes them, and only unpinned leaves are evicted, least recently used
first, to keep the bytes held within `budget_bytes`. A block that does not fit is not stored.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Sequence

import numpy as np


@dataclasses.dataclass(eq=False)
class Block:
    parent: "Block | None"
    tokens: tuple[int, ...]
    data: tuple  # per cache of the state: (keys [L, H, block, hd], values [L, H, block, hd]) numpy arrays
    nbytes: int
    children: dict = dataclasses.field(default_factory=dict)
    refs: int = 0
    used: int = 0


class PrefixCache:
    """Blocks of `block` tokens, at most `budget_bytes` held. `metrics`: a kvjax.serve.metrics.Metrics (or None).
    Thread-safe: prefill workers of a disaggregated engine share one cache."""

    def __init__(self, block: int, budget_bytes: int, metrics=None):
        if block < 1 or budget_bytes < 0:
            raise ValueError(f"prefix cache: block must be >= 1 token and the budget >= 0 bytes, got {block}, "
                             f"{budget_bytes}")
        self.block, self.budget = int(block), int(budget_bytes)
        self.metrics = metrics
        self.root = Block(None, (), (), 0)
        self.bytes = 0
        self.blocks = 0
        self._tick = itertools.count(1)
        self._lock = threading.Lock()

    # ---- lookup ------------------------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> list[Block]:
        """The longest chain of cached blocks that `tokens` starts with, pinned (release() it after the prefill)."""
        chain, node, b = [], self.root, self.block
        with self._lock:
            for i in range(len(tokens) // b):
                node = node.children.get(tuple(tokens[i * b:(i + 1) * b]))
                if node is None:
                    break
                node.refs += 1
                node.used = next(self._tick)
                chain.append(node)
            if self.metrics is not None:
                self.metrics.prefix_lookups.inc()
                self.metrics.prefix_lookup_tokens.inc(len(tokens))
                if chain:
                    self.metrics.prefix_hits.inc()
                    self.metrics.prefix_reused_tokens.inc(len(chain) * b)
        return chain

    def release(self, chain: Sequence[Block]) -> None:
        with self._lock:
            for node in chain:
                node.refs -= 1

    # ---- filling a state and storing from one ------------------------------------------------------------------

    @staticmethod
    def fill(host: list, row: int, chain: Sequence[Block]) -> None:
        """Write `chain`'s blocks into row `row` of a host state (per cache: (keys, values), each a list of per-layer
        numpy arrays [B, H, T, hd]) at positions 0 .. len(chain) * block."""
        at = 0
        for node in chain:
            n = len(node.tokens)
            for (keys, values), (k, v) in zip(host, node.data):
                for layer, (kb, vb) in enumerate(zip(keys, values)):
                    kb[row, :, at:at + n] = k[layer]
                    vb[row, :, at:at + n] = v[layer]
            at += n

    def store(self, tokens: Sequence[int], chain: list[Block], host: list, row: int) -> list[Block]:
        """Add the full blocks of `tokens` past `chain` (row `row` of the host state holds their caches); returns the
        chain extended by them, pinned (release() it). A block another prompt stored meanwhile is reused; a block
        that does not fit in the budget (after evicting what may be evicted) ends the chain."""
        b = self.block
        with self._lock:
            node = chain[-1] if chain else self.root
            for i in range(len(chain), len(tokens) // b):
                key = tuple(tokens[i * b:(i + 1) * b])
                child = node.children.get(key)
                if child is None:
                    data = tuple((np.stack([kb[row, :, i * b:(i + 1) * b] for kb in keys]),
                                  np.stack([vb[row, :, i * b:(i + 1) * b] for vb in values])) for keys, values in host)
                    nbytes = sum(k.nbytes + v.nbytes for k, v in data)
                    if not self._make_room(nbytes):
                        break
                    child = Block(node, key, data, nbytes)
                    node.children[key] = child
                    self.bytes += nbytes
                    self.blocks += 1
                child.refs += 1
                child.used = next(self._tick)
                chain.append(child)
                node = child
            self._gauges()
        return chain

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned leaves, least recently used first, until `nbytes` more fit (lock held)."""
        if nbytes > self.budget:
            return False
        if self.bytes + nbytes <= self.budget:
            return True
        leaves = sorted((n for n in self._nodes() if not n.children and n.refs == 0), key=lambda n: n.used)
        while self.bytes + nbytes > self.budget and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.tokens]
            self.bytes -= leaf.nbytes
            self.blocks -= 1
            if self.metrics is not None:
                self.metrics.prefix_evictions.inc()
            if parent is not self.root and not parent.children and parent.refs == 0:  # now a leaf: by age
                leaves.append(parent)
                leaves.sort(key=lambda n: n.used)
        return self.bytes + nbytes <= self.budget

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.prefix_bytes.set(self.bytes)
            self.metrics.prefix_blocks.set(self.blocks)

    def stats(self) -> dict:
        with self._lock:
            return {"block": self.block, "blocks": self.blocks, "bytes": self.bytes, "budget_bytes": self.budget,
                    "pinned": sum(n.refs > 0 for n in self._nodes())}
