"""The block drafter (DFlash-style) for lossless speculative decoding: a small model that reads the verifier's hidden
features and drafts a whole block of tokens in one forward pass.

  config   DrafterConfig (frozen): layer shapes, the verifier layers it reads, trained block sizes, the verifier's
           config fingerprint
  model    its params (ParamSpec table), the context cache of verifier features, the block forward, training logits
  io       save_drafter / load_drafter (a directory: drafter.safetensors + manifest.json)
  block    BlockDrafter: the drafter of the shared verify loop (kvjax.speculative), block_drafter, load_block_drafter
  train    data (the verifier's greedy continuations and features, cached) and optax training
"""

from kvjax.drafter.block import BlockDrafter, BlockState, block_drafter, load_block_drafter
from kvjax.drafter.config import DrafterConfig, drafter_config
from kvjax.drafter.io import DrafterError, load_drafter, save_drafter
from kvjax.drafter.model import DrafterParams, init_drafter

__all__ = ["BlockDrafter", "BlockState", "block_drafter", "load_block_drafter", "DrafterConfig", "drafter_config",
           "DrafterError", "load_drafter", "save_drafter", "DrafterParams", "init_drafter"]
