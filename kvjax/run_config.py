"""The typed configuration of `python -m kvjax.launch`: one frozen dataclass tree, every field commented once.

A named config is a file configs/NAME.py whose `get_config()` returns a RunConfig; `--config.a.b=value` overrides any
field (kvjax.config_flags). Paths are relative to the current directory (the repository root for the shipped ones).
"""

from __future__ import annotations

import dataclasses

from kvjax.gate import GateConfig
from kvjax.mapper.residual import ResidualConfig

ARMS = ("target", "source", "direct", "ridge", "residual")  # every arm an evaluation can score


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
    env: str = ""  # environment variable that supplies the directory when `path` is empty
    name: str = ""  # display name in the report, e.g. "Qwen3-32B" (default: the directory name)
    dtype: str = "float32"  # parameter and cache dtype: float32 (CPU) or bfloat16 (accelerators)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # text the map is calibrated and its residual trained on; each entry is "stdlib:train" / "stdlib:heldout" (this
    # machine's Python standard library, split by `manifest`), a local .txt file (one document), a .jsonl file (one
    # document per record, field `text_field`) or a .npy array of token ids
    train_text: tuple[str, ...] = ("stdlib:train",)
    # held-out text: cut into the evaluation windows when `heldout_windows` is empty, and the haystacks of generated
    # retrieval items
    heldout_text: tuple[str, ...] = ("stdlib:heldout",)
    heldout_windows: str = ""  # .npy int [N, T] held-out token windows (distances, KL, throughput prompts)
    heldout_window_len: int = 1025  # length of the windows cut from `heldout_text`
    manifest: str = "checkpoints/toy/data/manifest.json"  # train / held-out split of the stdlib files
    text_field: str = "text"  # the field of .jsonl records
    max_train_tokens: int = 1_000_000  # tokens read from `train_text`
    max_heldout_tokens: int = 300_000  # tokens read from `heldout_text`


@dataclasses.dataclass(frozen=True)
class MapConfig:
    calib_windows: int = 128  # calibration windows (of `window_len` tokens) drawn from the training text
    select_windows: int = 16  # separate windows on which lambda is chosen
    window_len: int = 512
    batch_size: int = 8  # windows per calibration batch
    pairing: str = "depth"  # "depth" (nearest relative depth) or "topK" (K best source layers by held-out R^2)
    rank: int | None = None  # reduced-rank ridge (None: full rank)
    residual_rank: int = 16  # hidden width of the residual network


@dataclasses.dataclass(frozen=True)
class DistancesEval:
    enabled: bool = True
    windows: int = 16  # held-out windows (the first rows of the held-out windows)
    window_len: int = 512
    batch_size: int = 8


@dataclasses.dataclass(frozen=True)
class KLEval:
    enabled: bool = True
    windows: int = 64  # held-out windows after the distance windows (disjoint rows)
    prefix_len: int = 256  # tokens the source reads and the map translates
    cont_len: int = 64  # continuation tokens scored
    batch_size: int = 8


@dataclasses.dataclass(frozen=True)
class MCEval:
    enabled: bool = True
    hellaswag: str = "checkpoints/toy/eval/hellaswag.jsonl"  # local JSONL or hub dataset name; "" skips the set
    piqa: str = "checkpoints/toy/eval/piqa.jsonl"  # local JSONL or hub dataset name; "" skips the set
    split: str = "validation"  # split of hub datasets
    limit: int | None = 200  # first N items of each set (None: all)
    normalize: str = "length"  # option score: "length" (per token), "bytes" (acc_norm) or "none" (sum)
    arms: tuple[str, ...] = ARMS
    batch_size: int = 8  # items scored together (x options rows)


@dataclasses.dataclass(frozen=True)
class RetrievalEval:
    enabled: bool = True
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt lengths in tokens
    # JSONL sets, "{length}" is replaced by each length; "" generates needle items from the held-out text
    files: str = "checkpoints/toy/eval/retrieval_{length}.jsonl"
    limit: int = 20  # items per length
    arms: tuple[str, ...] = ("target", "source", "residual")
    batch_size: int = 8  # items decoded together


@dataclasses.dataclass(frozen=True)
class ThroughputEval:
    enabled: bool = True
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # prefix lengths (tokens of held-out text)
    new_tokens: int = 64  # fixed generation length; decode tok/s counts the tokens after the first
    repeats: int = 5  # timed rounds after a warm-up round (arms interleaved); medians are reported
    decode_repeats: int = 5  # decode phase re-runs per round from the same cache (its median): short decodes are noisy
    # target and mapped decode tok/s from this many alternating timings of the two decodes (0: from the rounds)
    paired_decode: int = 15
    batch_size: int = 1  # requests decoded together


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    distances: DistancesEval = DistancesEval()
    kl: KLEval = KLEval()
    mc: MCEval = MCEval()
    retrieval: RetrievalEval = RetrievalEval()
    throughput: ThroughputEval = ThroughputEval()
    bootstrap: int = 10_000  # bootstrap resamples for the 95% intervals


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # batch-parallel mesh axis
    model: int = 0  # head/FFN-parallel mesh axis; 0 = every device not used by `data`


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str  # config name, shown in the report
    source: ModelConfig  # the large model that reads the prompt
    target: ModelConfig  # the small model that answers
    output_dir: str  # run directory: stage artifacts, log, report
    data: DataConfig = DataConfig()
    map: MapConfig = MapConfig()
    residual: ResidualConfig = ResidualConfig()  # residual training (steps=0: ridge only)
    eval: EvalConfig = EvalConfig()
    gate: GateConfig = GateConfig()
    mesh: MeshConfig = MeshConfig()
    seed: int = 0  # window draws (calibration, lambda selection); bootstrap and residual seeds are their own
