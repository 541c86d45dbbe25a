"""LM pretraining's settings (``kvjax.pretrain``), in a module without JAX, optax or orbax, so that a training config
(launch/toy/config.py) can be built and read without importing the trainer."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 1024  # tokens per training window (the model sees positions 0..seq_len-1)
    batch_size: int = 8  # windows per step
    steps: int = 1000  # total optimizer steps (the length of the LR schedule)
    end_at: int | None = None  # stop after this step although the schedule runs to `steps` (a phase cut short)
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine decay)
    warmup_steps: int = 100  # linear warmup from 0
    weight_decay: float = 0.1  # decoupled, on matrices only (not norms)
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping
    init_std: float = 0.02  # std of the normal initialiser for matrices
    seed: int = 0  # parameter init and batch order
    eval_every: int = 100  # steps between held-out evaluations
    eval_batches: int = 4  # fixed held-out batches per evaluation
    save_every: int = 100  # steps between checkpoints
    remat: bool = False  # recompute activations in the backward pass (less memory, ~30% more compute)
    # copy augmentation: this fraction of training windows gets `copy_spans` spans of copy_len[0]..copy_len[1]
    # tokens repeated verbatim later in the same window. Small models on a few million tokens of text never form
    # induction heads (measured: a repeated held-out passage is barely easier the second time); repeats make copying
    # pay off early, which in-context retrieval needs. 0 = plain windows.
    copy_prob: float = 0.0
    copy_spans: int = 4
    copy_len: tuple[int, int] = (16, 64)
    # tokens between the end of a span and the start of its copy, drawn uniformly from [lo, hi]; None = the copy goes
    # anywhere after its span (most copies then sit a few hundred tokens away: long-range recall stays untrained)
    copy_gap: tuple[int, int] | None = None
    # fraction of spans whose content is first replaced by tokens drawn at random from the same window: the copy is
    # then predictable only by recall (ordinary text is half-predictable from local context, so copying it teaches
    # little precise long-range recall, e.g. of a number)
    copy_random: float = 0.0
    # fraction of those random spans shaped as a fact: a key of copy_cue[0]..copy_cue[1] window tokens, the fixed
    # tokens `copy_sep` (e.g. " ="), then tokens drawn from `copy_values` (e.g. digits), recalled as a whole when the
    # key reappears. With several facts per window sharing the separator, the separator alone does not say which value
    # follows: the model must match the whole key, as in needle retrieval ("_cfg_qmzx = 41199" ... "_cfg_qmzx =")
    copy_values: tuple[int, ...] = ()
    copy_value_frac: float = 0.0
    copy_cue: tuple[int, int] = (2, 6)
    copy_sep: tuple[int, ...] = ()
    # this fraction of windows is replaced by the pure induction task: `repeat_span` tokens drawn at random from the
    # data, repeated until the window is full, so everything after the first period is predictable only by copying
    repeat_prob: float = 0.0
    repeat_span: int = 128
