"""The typed configuration of `python -m kvjax.launch`: one frozen dataclass tree, every field commented once.

A named config is a file configs/NAME.py whose `get_config()` returns a RunConfig; `--config.a.b=value` overrides any
field (kvjax.config_flags). Paths are relative to the current directory (the repository root for the shipped ones).
"""

from __future__ import annotations

import dataclasses

from kvjax.eval.suite import eval_config_type
from kvjax.eval.suite.distances import DistancesEval
from kvjax.eval.suite.kl import KLEval
from kvjax.eval.suite.mc import MCEval
from kvjax.eval.suite.native_kl import NativeKLEval
from kvjax.eval.suite.retrieval import RetrievalEval
from kvjax.eval.suite.speculative import SpeculativeEval
from kvjax.eval.suite.throughput import ThroughputEval
from kvjax.eval.suite.ttft import TTFTEval
from kvjax.eval.arm_settings import ArmSettings
from kvjax.eval.gate import GateConfig
from kvjax.fitting.residual_config import ResidualConfig

__all__ = ["ModelConfig", "DataConfig", "MapConfig", "PeerConfig", "EvalConfig", "MeshConfig", "RunConfig",
           "DistancesEval", "KLEval", "MCEval", "RetrievalEval", "ThroughputEval", "NativeKLEval", "TTFTEval",
           "SpeculativeEval"]


DEFAULT_CONFIG = "toy_pruned_quick"  # the run the commands take without --config: the shipped pair, minutes on 2 cores


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF checkpoint directory (config.json, *.safetensors, tokenizer.json)
    env: str = ""  # environment variable that supplies the directory when `path` is empty
    name: str = ""  # display name in the report, e.g. "Qwen3-32B" (default: the directory name)
    dtype: str = "float32"  # parameter and cache dtype: float32 (CPU) or bfloat16 (accelerators)
    # a directory holding the model's config.json alone (e.g. configs/models/Qwen3-32B): its shapes, for a
    # compile-only plan (kvjax.plan) on a machine without the checkpoint; the checkpoint's own config.json wins
    shapes: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # text the map is calibrated and its residual trained on; each entry is "stdlib:train" / "stdlib:heldout" (this
    # machine's Python standard library, split by `manifest`), "pydoc:..." (the documentation the toy models read
    # besides code, Debian's python3.11-doc), "corpus:..." (both, mixed: all the toy models read), a local .txt file
    # (one document), a .jsonl file (one document per record, field `text_field`), a .npy array of token ids, or a
    # dataset "hf:NAME[:CONFIG[:SPLIT]]" (a hub name such as HuggingFaceFW/fineweb-edu, or a local copy: a
    # save_to_disk directory or .parquet / .jsonl files), streamed, its calibration documents (see heldout_share);
    # kvjax.corpus
    train_text: tuple[str, ...] = ("stdlib:train",)
    # held-out text: cut into the evaluation windows when `heldout_windows` is empty, and the haystacks of generated
    # retrieval items; an hf: dataset gives its held-out documents here, never one of its calibration documents
    heldout_text: tuple[str, ...] = ("stdlib:heldout",)
    heldout_windows: str = ""  # .npy int [N, T] held-out token windows (distances, KL, throughput prompts)
    heldout_window_len: int = 1025  # length of the windows cut from `heldout_text`
    manifest: str = "checkpoints/toy/data/manifest.json"  # train / held-out split of the stdlib files
    text_field: str = "text"  # the field of .jsonl and hf: records
    max_train_tokens: int = 1_000_000  # tokens read from `train_text`
    max_heldout_tokens: int = 300_000  # tokens read from `heldout_text`
    # hf: sources: the share of documents held out, each decided by a hash of its text salted with `split_seed`
    # (kvjax.corpus.is_heldout); the tokens read are cached in the run directory's corpus/
    heldout_share: float = 0.2
    split_seed: int = 0

    def hashed(self) -> dict:
        """The settings as the calibrate stage's hash records them: fields added later only when they differ from
        their default, so that runs made before those fields existed keep their hashes."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in DATA_ADDED_LATER or v != DATA_ADDED_LATER[k]}


DATA_ADDED_LATER = {"heldout_share": 0.2, "split_seed": 0}  # field -> its default (see DataConfig.hashed)


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
class PeerConfig:
    # > 0: also fit the per-head ridge peer (kvjax.fitting.perhead: Heo et al.; each target KV head on its top-k
    # source layers, fixed lambda, no residual) on the same calibration windows, as stage `perhead` and arm
    # "perhead" (score it with --config.eval.mc.arms=...,perhead); 0: not fitted
    perhead_topk: int = 0
    perhead_lambda: float = 1e-3  # relative to the mean eigenvalue of cov(x)
    # > 0: also fit the bridge map (kvjax.fitting.bridge, CacheBridge-style: each target KV head on its best
    # `bridge_topk` source KV heads of the ridge's paired layers, matched by held-out R^2, the fit weighting each
    # calibration token by the target's attention mass on it) as stage `bridge` and arm "bridge"; 0: not fitted
    bridge_topk: int = 0
    bridge_weighted: bool = True  # false: every token weight 1 (head matching alone)
    bridge_clip: float = 10.0  # weights clipped at this multiple of the window's mean (0: no clip)


# one field per evaluation of the job's registry (its settings: --config.eval.NAME.FIELD), then `bootstrap` (the
# resamples of every 95% interval, default 10,000)
EvalConfig = eval_config_type()


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # batch-parallel mesh axis
    model: int = 0  # head/FFN-parallel mesh axis; 0 = every device not used by `data`
    # memory per device the job may use, GB; 0: what the device reports (TPU, GPU). A CPU device reports none, so
    # the fit check before loading weights (kvjax.plan.check) runs on CPU only when this is set
    device_memory_gb: float = 0.0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str  # config name, shown in the report
    # the model that reads the prompt and the one that answers from the mapped cache: large reads / small answers
    # (configs/toy.py), or small reads / large answers (configs/toy_reverse.py); the names are roles, not sizes
    source: ModelConfig
    target: ModelConfig
    output_dir: str  # run directory: stage artifacts, log, report
    data: DataConfig = DataConfig()
    map: MapConfig = MapConfig()
    residual: ResidualConfig = ResidualConfig()  # residual training (steps=0: ridge only)
    eval: EvalConfig = EvalConfig()
    peers: PeerConfig = PeerConfig()  # peer maps fitted beside the run's own (arms in kvjax.eval.arms)
    arms: ArmSettings = ArmSettings()  # settings of the arms that take any (the partial-recomputation arm)
    gate: GateConfig = GateConfig()
    mesh: MeshConfig = MeshConfig()
    seed: int = 0  # window draws (calibration, lambda selection); bootstrap and residual seeds are their own
