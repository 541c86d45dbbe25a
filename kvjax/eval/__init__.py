"""Evaluation: likelihood scoring from a prefix cache (native or mapped), multiple choice, needle retrieval, and
bootstrap confidence intervals. Eval sets for the toy pair: launch/toy/evalsets.py -> checkpoints/toy/eval/.

The names below load on first use (PEP 562): the evaluations' settings (kvjax.eval.suite, kvjax.eval.arm_settings)
are part of the main job's config, which is read and checked before JAX starts.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvjax.eval.token_agreement import next_token_agreement
    from kvjax.eval.likelihood import continuation_logprobs, heldout_loss, native_prefix_cache, window_losses
    from kvjax.eval.multiple_choice import MCItem, MCResult, load_mc, score_mc
    from kvjax.eval.reading import reading_gap, reading_gaps
    from kvjax.eval.needle_retrieval import RetrievalItem, RetrievalResult, load_retrieval, score_retrieval
    from kvjax.eval.stats import CI, bootstrap_ci, paired_bootstrap_ci

_EXPORTS = {  # public name -> its module (the lines above)
    **dict.fromkeys(["next_token_agreement"], "kvjax.eval.token_agreement"),
    **dict.fromkeys(["continuation_logprobs", "heldout_loss", "native_prefix_cache", "window_losses"],
                    "kvjax.eval.likelihood"),
    **dict.fromkeys(["MCItem", "MCResult", "load_mc", "score_mc"], "kvjax.eval.multiple_choice"),
    **dict.fromkeys(["reading_gap", "reading_gaps"], "kvjax.eval.reading"),
    **dict.fromkeys(["RetrievalItem", "RetrievalResult", "load_retrieval", "score_retrieval"],
                    "kvjax.eval.needle_retrieval"),
    **dict.fromkeys(["CI", "bootstrap_ci", "paired_bootstrap_ci"], "kvjax.eval.stats"),
}

__all__ = [
    "continuation_logprobs", "heldout_loss", "native_prefix_cache", "window_losses", "MCItem", "MCResult", "load_mc",
    "score_mc", "RetrievalItem", "RetrievalResult", "load_retrieval", "score_retrieval", "CI", "bootstrap_ci",
    "paired_bootstrap_ci", "next_token_agreement", "reading_gap", "reading_gaps",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
