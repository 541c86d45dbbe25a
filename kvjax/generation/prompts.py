"""The one prompt preparation of every generating entry point (kvjax.generate, kvjax.generate_from and the split
path built on it, kvjax.speculative_generate and speculative_split_generate): prompts in either form to checked
right-padded host arrays, the cache capacity, and the decoding settings with their defaults (EOS from the config,
the pad id from the call, else the config, else the first EOS, else 0)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from kvjax.generation.sampling import Sampling

CACHE_ALIGN = 128  # cache capacities are rounded up to a multiple of this: one compile serves many lengths


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a list of token lists: (tokens int32 [B, T], lengths int32 [B])."""
    if not len(prompts) or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), lengths.max()), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def aligned(n: int) -> int:
    """A cache capacity for n positions: n rounded up to a multiple of CACHE_ALIGN."""
    return -(-int(n) // CACHE_ALIGN) * CACHE_ALIGN


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Checked prompts and decoding settings. Pad positions of `tokens` hold 0 (a valid id), whatever the pad id."""

    tokens: np.ndarray  # int32 [B, T], right-padded
    lengths: np.ndarray  # int32 [B], each >= the entry point's minimum
    capacity: int  # cache positions: prompt + new tokens (+ what the entry point writes past them), aligned
    sampling: Sampling
    key: jax.Array  # the PRNG key (key(0) for greedy decoding, which ignores it)
    eos: tuple[int, ...]  # a row stops after emitting one of these
    pad: int  # what fills a row's output after it stopped

    @property
    def prefix(self) -> np.ndarray:
        """What a builder's cache holds when the answerer runs each prompt's last token itself: int32 [B, T'],
        T' = max(T - 1, 1)."""
        return np.ascontiguousarray(self.tokens[:, : max(self.tokens.shape[1] - 1, 1)])

    @property
    def prefix_lengths(self) -> np.ndarray:
        return self.lengths - 1

    @property
    def last(self) -> np.ndarray:
        """Each prompt's last token int32 [B]: the first token the answerer runs after the prefix cache."""
        return self.tokens[np.arange(len(self.tokens)), self.lengths - 1]


def prepare(prompts, cfgs, max_new_tokens: int, *, prompt_lengths=None, temperature: float = 0.0,
            top_p: float = 1.0, key=None, eos_token_ids=None, pad_token_id: int | None = None, extra: int = 0,
            min_length: int = 1, check_positions: bool = False, what: str = "generate") -> Prepared:
    """Prompts -> Prepared, every check before any compute (a ValueError naming the fix).

    `prompts`: token lists of any lengths, or an integer array [B, T] (a 1-D array is one prompt) whose rows are all
    real unless `prompt_lengths` [B] says how many are. `cfgs`: the config of the model that answers (its EOS, pad id
    and vocabulary are the defaults), or a tuple of configs whose vocabularies all must hold the ids (the answerer's
    first). `extra`: cache positions an entry point writes past prompt + max_new_tokens (a speculative round writes
    draft_len + 1). `min_length`: the shortest prompt the entry point takes. `check_positions`: refuse prompt + new +
    extra positions past a model's max_position_embeddings."""
    cfgs = tuple(cfgs) if isinstance(cfgs, (tuple, list)) else (cfgs,)
    cfg = cfgs[0]
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = Sampling(float(temperature), float(top_p))
    if sampling.temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs an explicit key=jax.random.key(seed)")
    if isinstance(prompts, (list, tuple)) and prompts and not np.isscalar(prompts[0]):
        tokens, lengths = pad_prompts(prompts)
    else:
        tokens = np.asarray(prompts)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"prompts must be token lists or an integer array [B, T], got {tokens.dtype}"
                             f"{tokens.shape}")
        lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32)
    if prompt_lengths is not None:  # a right-padded array whose rows are shorter: one compile for many lengths
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (tokens.shape[0],) or lengths.min() < 1 or lengths.max() > tokens.shape[1]:
            raise ValueError(f"prompt_lengths must be [B] in 1..{tokens.shape[1]}, got {lengths}")
    lengths = lengths.astype(np.int32)
    if lengths.min() < min_length:
        raise ValueError(f"{what} needs prompts of at least {min_length} tokens (all but the last are prefilled), "
                         f"got a prompt of {int(lengths.min())}")
    real = np.arange(tokens.shape[1])[None] < lengths[:, None]
    for c in cfgs:
        bad = real & ((tokens < 0) | (tokens >= c.vocab_size))
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{what}: prompt token ids must be in [0, {c.vocab_size}) (the model's vocab_size), got "
                             f"{int(tokens[at])} at index {list(at)}; encode with the tokenizer of this model")
    tokens = np.where(real, tokens, 0).astype(np.int32)
    need = tokens.shape[1] + int(max_new_tokens) + int(extra)
    if check_positions:
        for c in cfgs:
            if need > c.max_position_embeddings:
                raise ValueError(f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens})"
                                 + (f" + {extra} positions a round writes ahead" if extra else "")
                                 + f" = {need} positions exceed the model's max_position_embeddings "
                                 f"({c.max_position_embeddings}); shorten the prompt or ask for fewer tokens")
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_token_ids is None else eos_token_ids))
    if pad_token_id is not None:
        pad = pad_token_id
    elif cfg.pad_token_id is not None:  # a pad id of 0 is a pad id, not "unset"
        pad = cfg.pad_token_id
    else:
        pad = eos[0] if eos else 0
    return Prepared(tokens=tokens, lengths=lengths, capacity=aligned(need), sampling=sampling,
                    key=key if key is not None else jax.random.key(0), eos=eos, pad=int(pad))
