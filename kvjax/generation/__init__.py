"""Generation: how the next token is picked (sampling), the one prompt preparation (prompts), and the compiled
decode loop with its entry points `generate` (the model's own prefill) and `generate_from` (any cache builder)."""

from kvjax.generation.sampling import Sampling, draw, row_sampling_probs, sample, sample_rows, sampling_probs
from kvjax.generation.prompts import CACHE_ALIGN, Prepared, aligned, pad_prompts, prepare
from kvjax.generation.loop import (alternating_decode_seconds, decode_from, decode_loop, generate, generate_from,
                                  greedy_continuation)

__all__ = ["Sampling", "draw", "row_sampling_probs", "sample", "sample_rows", "sampling_probs", "CACHE_ALIGN",
           "Prepared", "aligned", "pad_prompts", "prepare", "alternating_decode_seconds", "decode_from", "decode_loop",
           "generate", "generate_from", "greedy_continuation"]
