"""Speculative decoding: a drafter proposes tokens, the verifier checks them in one forward, output stays the
verifier's (kvjax.speculative.loop documents the shared loop and the drafter interface).

  loop     the compiled verify loop, acceptance rules (greedy / rejection sampling), Stats
  draft    ModelDrafter: a small causal LM drafting from its own cache
  lookup   LookupDrafter: prompt lookup, drafting what followed the context's latest n-gram match (no model)
  combined CombinedDrafter: lookup's draft where the text repeats, a model drafter's (the block drafter) elsewhere
  cost     the cost model: a run's speed-up predicted from its widths and rounds and the measured cost of each part
  api      speculative_generate, speculative_split_generate (speculative KV transfer), transfer_builder
"""

from kvjax.speculative.api import SpecResult, speculative_generate, speculative_split_generate, transfer_builder
from kvjax.speculative.combined import CombinedDrafter, CombinedState, combined
from kvjax.speculative.draft import DraftState, ModelDrafter
from kvjax.speculative.lookup import LookupDrafter, LookupState
from kvjax.speculative.loop import (Stats, accept_greedy, accept_sampled, accept_sampled_rows, run_loop,
                                   sampling_probs, verify_block, verify_loop, verify_round)

__all__ = ["CombinedDrafter", "CombinedState", "combined", "SpecResult", "speculative_generate",
           "speculative_split_generate", "transfer_builder", "DraftState", "ModelDrafter", "LookupDrafter",
           "LookupState", "Stats", "accept_greedy", "accept_sampled", "accept_sampled_rows", "run_loop",
           "sampling_probs", "verify_block", "verify_loop", "verify_round"]
