"""Evaluation: likelihood scoring from a prefix cache (native or mapped), multiple choice, needle retrieval, and
bootstrap confidence intervals. Eval sets for the toy pair: launch/toy/evalsets.py -> checkpoints/toy/eval/."""

from kvjax.eval.agreement import next_token_agreement
from kvjax.eval.likelihood import continuation_logprobs, heldout_loss, native_prefix_cache, window_losses
from kvjax.eval.multiple_choice import MCItem, MCResult, load_mc, score_mc
from kvjax.eval.reading import reading_gap, reading_gaps
from kvjax.eval.retrieval import RetrievalItem, RetrievalResult, load_retrieval, score_retrieval
from kvjax.eval.stats import CI, bootstrap_ci, paired_bootstrap_ci

__all__ = [
    "continuation_logprobs", "heldout_loss", "native_prefix_cache", "window_losses", "MCItem", "MCResult", "load_mc",
    "score_mc", "RetrievalItem", "RetrievalResult", "load_retrieval", "score_retrieval", "CI", "bootstrap_ci",
    "paired_bootstrap_ci", "next_token_agreement", "reading_gap", "reading_gaps",
]
