"""kvjax: large model reads, small model answers. KV-cache transfer between Qwen3 and Llama models in JAX.

The public names below load on first use (PEP 562): `import kvjax` by itself imports no JAX, so the command lines
(`python -m kvjax.launch`, `python -m kvjax.serve`) read and check their flags, config and checkpoints in well under
a second and report a mistake before JAX starts. The import lines under TYPE_CHECKING are the table: each name is
taken from its module the first time it is asked for (`kvjax.load_hf`, `from kvjax import load_hf`).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvjax.cache import KVCache, init_cache
    from kvjax.generation import Sampling, generate, generate_from, pad_prompts
    from kvjax.hf import CheckpointError, load_hf, load_hf_config, load_tokenizer, save_hf
    from kvjax.models.config import ConfigError, Qwen3Config
    from kvjax.models.family import DecoderConfig
    from kvjax.models.llama import LlamaConfig
    from kvjax.models.model import Model
    from kvjax.models.params import Params, init_params
    from kvjax.models.decoder import decode_step, prefill
    from kvjax.builders import CacheBuilder, Mapped, NativePrefill, PartialRecompute, Pipelined
    from kvjax.mapper.artifact import load_map, save_map
    from kvjax.fitting.fit import fit_map
    from kvjax.mapper.kvmap import KVMap, apply_map
    from kvjax.fitting.residual import ResidualConfig, train_residual
    from kvjax.split import SplitResult, native_generate, split_generate
    from kvjax.eval.gate import GateResult, load_gate
    from kvjax.speculative import SpecResult, speculative_generate, speculative_split_generate
    from kvjax.tensorfile import SafetensorsError
    from kvjax.models.audio_lm import AudioLM
    from kvjax.hf.ultravox import load_audio_encoder, load_ultravox

__version__ = "0.1.0"
__all__ = [
    "KVCache", "init_cache", "generate", "Sampling", "pad_prompts", "load_hf", "load_hf_config", "load_tokenizer",
    "save_hf", "Model", "DecoderConfig", "Qwen3Config", "LlamaConfig", "ConfigError", "CheckpointError",
    "SafetensorsError", "Params", "init_params", "prefill", "decode_step", "CacheBuilder", "NativePrefill", "Mapped",
    "Pipelined", "PartialRecompute", "generate_from", "KVMap", "fit_map", "apply_map", "save_map", "load_map",
    "train_residual", "ResidualConfig", "split_generate", "native_generate", "SplitResult", "GateResult", "load_gate",
    "speculative_generate", "speculative_split_generate", "SpecResult",
    "load_audio_encoder", "load_ultravox", "AudioLM",
]


def _exports() -> dict[str, str]:
    """Public name -> its module, read from the TYPE_CHECKING import lines of this file."""
    import ast
    with open(__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {a.asname or a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


_EXPORTS: dict[str, str] | None = None


def __getattr__(name: str):
    import importlib
    global _EXPORTS
    if _EXPORTS is None:
        _EXPORTS = _exports()
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    if not name.startswith("__"):  # a submodule not imported yet: `import kvjax; kvjax.hf.load_tokenizer(...)`
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
