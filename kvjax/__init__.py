"""kvjax: large model reads, small model answers. KV-cache transfer between Qwen3 and Llama models in JAX."""

from kvjax.cache import KVCache, init_cache
from kvjax.generation import Sampling, generate, pad_prompts
from kvjax.hf import CheckpointError, load_hf, load_hf_config, load_tokenizer, save_hf
from kvjax.models.config import ConfigError, Qwen3Config
from kvjax.models.llama import LlamaConfig
from kvjax.models.model import Model
from kvjax.models.params import Params, init_params
from kvjax.models.decoder import decode_step, prefill
from kvjax.builders import CacheBuilder, Mapped, NativePrefill, PartialRecompute, Pipelined
from kvjax.mapper.artifact import load_map, save_map
from kvjax.mapper.fit import fit_map
from kvjax.mapper.kvmap import KVMap, apply_map
from kvjax.mapper.residual import ResidualConfig, train_residual
from kvjax.mapper.split import SplitResult, generate_from, native_generate, split_generate
from kvjax.gate import GateResult, load_gate
from kvjax.speculative import SpecResult, speculative_generate, speculative_split_generate
from kvjax.tensorfile import SafetensorsError

__version__ = "0.1.0"
__all__ = [
    "KVCache", "init_cache", "generate", "Sampling", "pad_prompts", "load_hf", "load_hf_config", "load_tokenizer",
    "save_hf", "Model", "Qwen3Config", "LlamaConfig", "ConfigError", "CheckpointError", "SafetensorsError", "Params",
    "init_params", "prefill", "decode_step", "CacheBuilder", "NativePrefill", "Mapped", "Pipelined", "PartialRecompute",
    "generate_from", "KVMap", "fit_map", "apply_map", "save_map", "load_map", "train_residual",
    "ResidualConfig", "split_generate", "native_generate", "SplitResult", "GateResult", "load_gate",
    "speculative_generate", "speculative_split_generate", "SpecResult",
]
