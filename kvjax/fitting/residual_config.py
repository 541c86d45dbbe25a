"""The residual training's settings, in a module without JAX, optax or orbax, so that a run config
(``kvjax.run.config``) can hold them without importing the trainer (``kvjax.fitting.residual``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ResidualConfig:
    steps: int = 200  # optimizer steps
    batch_size: int = 8  # windows per step
    prefix_len: int = 256  # tokens the source reads and the map translates (the target's cache)
    cont_len: int = 64  # continuation tokens scored by KL
    lr: float = 1e-3  # peak learning rate (warmup + cosine)
    warmup_steps: int = 20
    grad_clip: float = 1.0
    rollout: bool = False  # continuation = the target's own greedy rollout from the mapped cache
    # whose next-token distributions the student (the target reading the mapped cache) learns: "source" (the reader,
    # when it is the stronger model: large reads, small answers) or "target" (the answerer's own native predictions,
    # having read the prefix itself: small reads, large answers, where the reader is the weaker model)
    teacher: str = "source"
    # > 0: draw this many windows once and run the frozen models on them once (kvjax.fitting.teacher_pool); each step
    # then reads a batch of them (epochs in a seeded order) and runs only the map and the target: ~4x cheaper steps on
    # the toy pair, fewer distinct windows. 0: fresh windows every step, both models run per step
    pool_windows: int = 0
    seed: int = 0  # batch order
    # a saved map (its directory) whose residual (down, res_bias, up) training starts from instead of the ridge's fresh
    # one (up = 0: the ridge itself): a finished residual continued under a new schedule and seed (a warm restart), or
    # the rollout residual started from the KL residual. Its frozen ridge part must be this run's; "": a fresh start
    init_from: str = ""
    # > 0: the trained map is the exponential moving average of the residual's iterates, this decay per step (0.995:
    # a ~200-step horizon). A rollout-trained residual's held-out rollout divergence moves by points from one checkpoint
    # to the next (a small change of the map flips greedy tokens and the rollouts with them); the average of nearby
    # iterates is steadier. 0: the last iterate
    ema: float = 0.0
    save_every: int = 50  # checkpoint interval (steps)
    # > 0: a context map (kvjax.mapper.kvmap, LinearMap.down_prev): the residual also reads the source's features at
    # this many positions before each one, not each position alone (the ridge part stays per position): a target
    # that lost the source's previous-token layer needs keys that carry their neighbours (measured: KL -1.6 to -2.5%,
    # docs/method.md). The Pallas map kernel maps positions alone: context maps run the XLA map. 0: off
    context: int = 0
    # which of each layer's maps read the context: "kv" both, "k" the keys only (what the target's attention finds a
    # position by: a needle's key token after its neighbour), "v" the values only (what it copies from there)
    context_kinds: str = "kv"
    # > 0: a cross-position map (kvjax.mapper.kvmap, LinearMap.att_*): the residual's hidden layer also reads a causal
    # attention of this many heads, `attention_dim` wide each, over the source's features of every position so far
    # (the C2C / Latent Cache Flow class: what a per-position or context map cannot compute). The Pallas map kernel
    # maps positions alone: such maps run the XLA map. 0: off
    attention_heads: int = 0
    attention_dim: int = 32
    # True: the ridge part (w_in, w_out, bias; not mu or scale) trains too, end to end on the same loss, at
    # `ridge_lr` x the residual's learning rate (the closed-form fit is its start). False: the ridge stays frozen
    train_ridge: bool = False
    ridge_lr: float = 0.1
    # > 0: fact-copy windows (kvjax.fitting.copy_windows) mixed into every step, this many drawn once into a pool as
    # pool_windows does: `copy_len` tokens of training text with a `copy_span`-token "key<separator>value" fact
    # written 64..copy_len-64 tokens before the end, then repeated; KL to the teacher on the repeat. The ordinary
    # windows never hold a copy from further than prefix_len back, so without these the map learns nothing a needle
    # answer needs (retrieval through the map 0%). 0: off
    copy_windows: int = 0
    copy_len: int = 1024  # text tokens before the repeat (the cache the map translates; the needle's distance)
    copy_span: int = 16  # tokens of the fact, repeated as the continuation
    # facts a fact-copy window holds, each repeated in the continuation (copy_facts x copy_span tokens): more to learn
    # from for the same pass of the map over the window's copy_len tokens, the step's costly part
    copy_facts: int = 1
    copy_batch: int = 4  # fact-copy windows per step, beside `batch_size` ordinary windows
    copy_weight: float = 0.5  # share of the step's loss on the fact-copy windows (the rest: the ordinary KL)
    # the fact's format as text, tokenized with the pair's tokenizer: the separator between key and value, and the
    # value alphabet (each symbol one token, as Qwen3 tokenizes digits); " = " and digits read like `timeout_x = 41199`.
    # Several separators joined by "|" (" = | -> | was "): each fact draws one, so the map learns more than one
    # format's copy. "*": each fact's separator is 1-3 tokens of its window's own text. Both aim at the RULER
    # evaluation's needle formats never seen in training (docs/method.md has what each did). A "?" in a separator is
    # one token of the window's text, drawn per fact ("? ": any token then a space), never a token of `copy_avoid`
    # (text, several joined by "|": e.g. the evaluation's own separators " is|:|\": \"", to keep them unseen)
    copy_separator: str = " = "
    copy_values: str = "0123456789"
    copy_avoid: str = ""

    @property
    def copy_window_len(self) -> int:
        """Tokens of one fact-copy window: its text, then every fact repeated."""
        return self.copy_len + self.copy_facts * self.copy_span

    def hashed(self) -> dict:
        """The settings as stage hashes and checkpoint identities record them: fields added later only when they
        differ from their default, so that runs made before those fields existed keep their hashes."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ADDED_LATER or v != ADDED_LATER[k]}


TEACHERS = ("source", "target")
CONTEXT_KINDS = ("kv", "k", "v")
# field -> its default (see ResidualConfig.hashed)
ADDED_LATER = {"teacher": "source", "pool_windows": 0, "init_from": "", "ema": 0.0, "copy_windows": 0,
               "copy_len": 1024, "copy_span": 16, "copy_facts": 1, "copy_batch": 4, "copy_weight": 0.5,
               "copy_separator": " = ", "copy_values": "0123456789", "copy_avoid": "", "context": 0,
               "context_kinds": "kv", "attention_heads": 0, "attention_dim": 32, "train_ridge": False, "ridge_lr": 0.1}
