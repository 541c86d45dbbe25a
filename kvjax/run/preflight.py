"""Checks before any work, in two rounds; each problem is reported with what to pass instead, all of a round's at once.

`check_fast` needs no JAX: the commands (python -m kvjax.launch, python -m kvjax.serve) run it before they import
JAX or restart under the allocator settings, so a wrong path is reported in well under a second. It covers the
model paths (flags or environment, `resolve_models`), each checkpoint's header (config.json readable and of a
model_type kvjax reads, the safetensors weights present, the target's tokenizer.json), the dtypes, the data files
the config names and, for a hub dataset the run has not cached yet, whether the hub can be reached (kvjax.corpus:
the offline settings, or a connection within 1.5 s). `validate` runs every check: these and those that read a
model's config or a registry (layer counts, the pair's tokenizer, the arms, each evaluation's settings and sets).
`make_mesh` builds the device mesh.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os

from kvjax.eval.gate import GateConfig
from kvjax.run.config import RunConfig

ROLES = ("source", "target")
CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"  # as kvjax.hf reads them
DTYPES = ("float32", "bfloat16")


class LaunchError(Exception):
    """A problem the user can fix; the message says how. Raised before any work whenever possible."""


def resolve_models(cfg: RunConfig) -> RunConfig:
    """Fill empty model paths from their environment variables; a missing checkpoint is an error naming both."""
    out = {}
    for role in ROLES:
        mc = getattr(cfg, role)
        path = mc.path or (os.environ.get(mc.env, "") if mc.env else "")
        if not path:
            how = f"set {mc.env}=/path/to/{mc.name or role} or pass" if mc.env else "pass"
            raise LaunchError(f"no {role} checkpoint given for {mc.name or role}: {how} "
                              f"--config.{role}.path=/path/to/{mc.name or role} (an HF directory with config.json "
                              "and *.safetensors)")
        if not os.path.isdir(path):
            via = f" (from ${mc.env})" if not mc.path and mc.env else ""
            raise LaunchError(f"{role} checkpoint directory {path!r}{via} does not exist; set "
                              f"--config.{role}.path{' or ' + mc.env if mc.env else ''} to an HF checkpoint directory")
        out[role] = dataclasses.replace(mc, path=path, name=mc.name or os.path.basename(os.path.normpath(path)))
    return dataclasses.replace(cfg, **out)


@functools.cache
def known_model_types() -> tuple[str, ...]:
    """The config.json model_types kvjax reads: those of the families kvjax/models/__init__.py imports, taken from
    their source (`register(Family(..., model_types=(...)))`), since importing a family imports JAX. Empty when the
    source does not read that way; the loader then judges the model_type once JAX is up."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
    found: list[str] = []
    try:
        with open(os.path.join(here, "__init__.py"), encoding="utf-8") as f:
            package = ast.parse(f.read())
        families = [a.name for n in package.body if isinstance(n, ast.ImportFrom)
                    and (n.module == "kvjax.models" or (n.level == 1 and not n.module)) for a in n.names]
        for name in families:
            with open(os.path.join(here, f"{name}.py"), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and "Family" in (getattr(node.func, "id", ""),
                                                               getattr(node.func, "attr", "")):
                    found += [t for kw in node.keywords if kw.arg == "model_types"
                              for t in ast.literal_eval(kw.value)]
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(found)


def checkpoint_problems(path: str) -> list[str]:
    """What makes `path` unloadable as a checkpoint, read from its header files only (no weights, no JAX): a missing
    directory, config.json missing, unreadable or of a model_type kvjax does not read, no safetensors weights."""
    if not os.path.isdir(path):
        return [f"checkpoint directory {path!r} does not exist; pass a directory with {CONFIG} and {SINGLE} (or "
                f"{INDEX})"]
    problems = []
    cfg_path = os.path.join(path, CONFIG)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            header = json.load(f)
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
    except FileNotFoundError:
        problems.append(f"{path} has no {CONFIG}; an HF checkpoint directory needs config.json next to its "
                        ".safetensors files")
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        problems.append(f"{cfg_path} is not readable JSON ({e}); re-download or re-save the checkpoint")
    else:
        known = known_model_types()
        if known and header.get("model_type") not in known:
            problems.append(f"{cfg_path}: model_type {header.get('model_type')!r} is not supported; kvjax reads "
                            f"checkpoints of model_type {', '.join(map(repr, known))}")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(f"{index} is not a valid safetensors index ({e!r}); re-save the checkpoint")
        else:
            missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
            if missing:
                problems.append(f"{INDEX} names shard {missing[0]!r} but {os.path.join(path, missing[0])} is "
                                f"missing{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the "
                                "download is incomplete")
    elif not os.path.isfile(os.path.join(path, SINGLE)):
        others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".safetensors")))
        hint = (f" It has {others}: kvjax reads only safetensors (never pickle); re-save with "
                "`model.save_pretrained(dir, safe_serialization=True)`." if others else "")
        problems.append(f"{path} has neither {SINGLE} nor {INDEX}.{hint}")
    return problems


def model_problems(cfg: RunConfig) -> list[str]:
    """The two checkpoints' headers (`checkpoint_problems`), their dtypes and the target's tokenizer.json."""
    problems = []
    for role in ROLES:
        mc = getattr(cfg, role)
        problems += [f"{role}: {p}" for p in checkpoint_problems(mc.path)]
        if mc.dtype not in DTYPES:
            problems.append(f"{role}.dtype={mc.dtype!r}: use float32 or bfloat16")
    if os.path.isdir(cfg.target.path) and not os.path.isfile(os.path.join(cfg.target.path, "tokenizer.json")):
        problems.append(f"target checkpoint {cfg.target.path} has no tokenizer.json (the pair's shared tokenizer)")
    return problems


def fast_problems(cfg: RunConfig) -> list[str]:
    """The problems `check_fast` reports (no JAX, nothing read beyond headers and file listings): the models'
    (`model_problems`) and the data files'."""
    from kvjax import corpus
    problems = model_problems(cfg)
    d = cfg.data
    reads = [("data.train_text", "train", d.train_text, d.max_train_tokens)]
    if not d.heldout_windows:
        reads.append(("data.heldout_text", "heldout", d.heldout_text, d.max_heldout_tokens))
    bad = False
    for _, _, sources, _ in reads:
        for source in sources:
            try:
                corpus.check_source(source, d.manifest)
            except corpus.CorpusError as e:
                problems.append(f"data: {e}")
                bad = True
    if not 0.0 < d.heldout_share < 1.0:
        problems.append(f"data.heldout_share={d.heldout_share}: must be in (0, 1) (the share of an hf: dataset's "
                        "documents held out)")
    elif not bad:  # a hub dataset the run's cache lacks, with the hub out of reach: one line, in at most ~1.5 s
        cache = corpus.Split(heldout_share=d.heldout_share, split_seed=d.split_seed,
                             cache_dir=os.path.join(cfg.output_dir, corpus.CACHE),
                             tokenizer_id=corpus.tokenizer_id(cfg.target.path))
        if why := corpus.hub_problem(reads, d.text_field, cache):
            problems.append(f"data: {why}")
    if not d.train_text:
        problems.append("data.train_text is empty: give the calibration text (e.g. stdlib:train)")
    if d.heldout_windows and not os.path.isfile(d.heldout_windows):
        problems.append(f"data.heldout_windows: no such file {d.heldout_windows}")
    if cfg.residual.init_from and not os.path.isfile(os.path.join(cfg.residual.init_from, "manifest.json")):
        problems.append(f"residual.init_from={cfg.residual.init_from!r} is not a saved map (no manifest.json): pass a "
                        "map directory fitted on this run's ridge (e.g. an earlier run's map/), or '' for a fresh one")
    return problems


def check_fast(cfg: RunConfig) -> None:
    """Raise LaunchError with every problem `fast_problems` finds (the checks `validate` adds run after it)."""
    if problems := fast_problems(cfg):
        raise LaunchError("the config has problems (nothing was run):\n  - " + "\n  - ".join(problems))


def validate(cfg: RunConfig) -> None:
    """Every check that needs no computation: `fast_problems` and those that read the models' configs, the pair's
    tokenizer and the registries; all problems are reported at once."""
    import numpy as np

    from kvjax.eval import suite
    from kvjax.hf import CheckpointError, load_hf_config, tokenizer_mismatch
    from kvjax.models.config import ConfigError

    problems = fast_problems(cfg)
    cfgs = {}
    for role in ROLES:
        if checkpoint_problems(getattr(cfg, role).path):
            continue  # reported above
        try:
            cfgs[role] = load_hf_config(getattr(cfg, role).path)
        except (CheckpointError, ConfigError) as e:
            problems.append(f"{role}: {e}")
    if len(cfgs) == 2:  # a map needs one tokenizer: equal vocab_size and tokenizer.json fingerprints
        try:
            if why := tokenizer_mismatch(cfg.source.path, cfg.target.path, cfgs["source"], cfgs["target"]):
                problems.append(why)
        except CheckpointError as e:
            problems.append(str(e))
    d = cfg.data
    rows_needed, len_needed, readers = suite.heldout_needed(cfg)
    if d.heldout_windows:
        if os.path.isfile(d.heldout_windows):  # (a missing file: fast_problems)
            shape = np.load(d.heldout_windows, mmap_mode="r").shape
            if len(shape) != 2 or shape[0] < rows_needed or shape[1] < len_needed:
                problems.append(f"data.heldout_windows {d.heldout_windows} has shape {shape}; the "
                                f"{' + '.join(readers)} evaluations need >= {rows_needed} rows of >= {len_needed} "
                                "tokens")
    elif d.heldout_window_len < len_needed:
        problems.append(f"data.heldout_window_len={d.heldout_window_len} is shorter than the {len_needed} tokens the "
                        f"{' / '.join(readers)} windows need")
    m = cfg.map
    if m.pairing != "depth" and not (m.pairing.startswith("top") and m.pairing[3:].isdigit()):
        problems.append(f"map.pairing={m.pairing!r}: use 'depth' or 'topK' (e.g. top2)")
    elif m.pairing != "depth" and "source" in cfgs and not 1 <= int(m.pairing[3:]) <= cfgs["source"].num_layers:
        problems.append(f"map.pairing={m.pairing}: K must be in 1..{cfgs['source'].num_layers}")
    for name, value in (("map.calib_windows", m.calib_windows), ("map.select_windows", m.select_windows),
                        ("map.window_len", m.window_len), ("map.batch_size", m.batch_size),
                        ("map.residual_rank", m.residual_rank), ("eval.bootstrap", cfg.eval.bootstrap),
                        ("residual.batch_size", cfg.residual.batch_size)):
        if value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    if cfg.residual.steps < 0:
        problems.append(f"residual.steps must be >= 0, got {cfg.residual.steps}")
    from kvjax.fitting.residual_config import TEACHERS
    if cfg.residual.teacher not in TEACHERS:
        problems.append(f"residual.teacher={cfg.residual.teacher!r}: use one of {', '.join(TEACHERS)}")
    if cfg.residual.pool_windows < 0 or (cfg.residual.pool_windows and cfg.residual.rollout):
        problems.append(f"residual.pool_windows={cfg.residual.pool_windows}: must be >= 0, and 0 with "
                        "residual.rollout (a rollout's continuation changes with the map, so it cannot be pooled)")
    if not 0 <= cfg.residual.context <= 8:
        problems.append(f"residual.context={cfg.residual.context}: use 0 (each position alone) or 1..8 previous "
                        "positions")
    from kvjax.fitting.residual_config import CONTEXT_KINDS
    if cfg.residual.context_kinds not in CONTEXT_KINDS:
        problems.append(f"residual.context_kinds={cfg.residual.context_kinds!r}: use kv (keys and values read the "
                        "context), k (keys only) or v (values only)")
    if not 0 <= cfg.residual.attention_heads <= 16 or cfg.residual.attention_dim < 2 or cfg.residual.attention_dim % 2:
        problems.append(f"residual.attention_heads={cfg.residual.attention_heads}, residual.attention_dim="
                        f"{cfg.residual.attention_dim}: use 0 heads (no cross-position attention) or 1..16 heads of an "
                        "even width >= 2 (RoPE rotates pairs)")
    if cfg.residual.ridge_lr <= 0:
        problems.append(f"residual.ridge_lr={cfg.residual.ridge_lr} must be > 0 (the ridge's learning rate as a "
                        "multiple of the residual's; residual.train_ridge=false keeps the ridge frozen)")
    if not 0.0 <= cfg.residual.ema < 1.0:
        problems.append(f"residual.ema={cfg.residual.ema}: must be in [0, 1) (e.g. 0.995; 0: the last iterate)")
    problems += copy_window_problems(cfg, cfgs)
    peers = cfg.peers
    if peers.perhead_topk < 0 or ("source" in cfgs and peers.perhead_topk > cfgs["source"].num_layers):
        problems.append(f"peers.perhead_topk={peers.perhead_topk}: use 0 (off) or 1..the source's layers")
    if peers.perhead_lambda <= 0:
        problems.append(f"peers.perhead_lambda={peers.perhead_lambda} must be > 0")
    paired = 1 if cfg.map.pairing == "depth" else int(cfg.map.pairing[3:]) if cfg.map.pairing[3:].isdigit() else 1
    heads = paired * cfgs["source"].num_kv_heads if "source" in cfgs else None  # the bridge's candidate heads
    if peers.bridge_topk < 0 or (heads is not None and peers.bridge_topk > heads):
        problems.append(f"peers.bridge_topk={peers.bridge_topk}: use 0 (off) or 1..the source KV heads of the layers "
                        f"the ridge pairs with a target layer ({heads if heads is not None else '?'} here)")
    if peers.bridge_clip < 0:
        problems.append(f"peers.bridge_clip={peers.bridge_clip}: use 0 (no clip) or a multiple of the mean weight > 0")
    problems += cfg.arms.problems(cfgs['target'].num_layers if 'target' in cfgs else None)
    problems += suite.preflight(cfg)  # each evaluation's settings and inputs (gate.cos_arm: distances)
    for f in dataclasses.fields(GateConfig):
        value = getattr(cfg.gate, f.name)
        ranged = any(word in f.name for word in ("cos", "retention", "retrieval"))
        if isinstance(value, (int, float)) and ranged and not -1 <= value <= 10:
            problems.append(f"gate.{f.name}={value} is out of range")
    if problems:
        raise LaunchError("the config has problems (nothing was run):\n  - " + "\n  - ".join(problems))


def copy_window_problems(cfg: RunConfig, model_cfgs: dict) -> list[str]:
    """The fact-copy windows' settings (residual.copy_*, kvjax.fitting.copy_windows) against the trainer, the models'
    positions, the training text and the pair's tokenizer."""
    from kvjax.hf import CheckpointError, load_tokenizer
    from kvjax.fitting.copy_windows import MIN_GAP, fact_format, max_facts
    rc, problems = cfg.residual, []
    if rc.copy_windows < 0:
        problems.append(f"residual.copy_windows={rc.copy_windows}: must be >= 0 (0: off)")
    if rc.copy_windows <= 0 or rc.steps == 0:
        return problems
    if rc.rollout:
        problems.append("residual.copy_windows with residual.rollout: a rollout replaces the continuation the copy "
                        "windows score; set residual.copy_windows=0 or residual.rollout=False")
    if rc.copy_batch < 1:
        problems.append(f"residual.copy_batch={rc.copy_batch}: must be >= 1 (fact-copy windows per step)")
    if not 0.0 < rc.copy_weight <= 1.0:
        problems.append(f"residual.copy_weight={rc.copy_weight}: must be in (0, 1] (the copies' share of the loss)")
    window = rc.copy_window_len
    if rc.copy_len < 2 * MIN_GAP or rc.copy_len < rc.copy_span + MIN_GAP:
        problems.append(f"residual.copy_len={rc.copy_len}: must be >= {2 * MIN_GAP} and >= copy_span + {MIN_GAP} "
                        "(the fact sits 64..copy_len-64 tokens back)")
    most = max_facts(rc.copy_len, rc.copy_span)
    if not 1 <= rc.copy_facts <= max(1, most):
        problems.append(f"residual.copy_facts={rc.copy_facts}: must be 1..{max(1, most)} (facts of "
                        f"copy_span={rc.copy_span} tokens, apart, within copy_len={rc.copy_len})")
    for role, mcfg in model_cfgs.items():
        if window > mcfg.max_position_embeddings:
            problems.append(f"residual.copy_len + copy_facts x copy_span = {window} exceeds the {role}'s "
                            f"max_position_embeddings {mcfg.max_position_embeddings}; lower residual.copy_len")
    if window + 2 > cfg.data.max_train_tokens:
        problems.append(f"residual.copy_len + copy_facts x copy_span = {window} is longer than the training text "
                        f"(data.max_train_tokens={cfg.data.max_train_tokens}); lower residual.copy_len")
    try:
        fmt = fact_format(load_tokenizer(cfg.target.path), rc.copy_separator, rc.copy_values, rc.copy_avoid)
        if rc.copy_span < fmt.min_span():
            problems.append(f"residual.copy_span={rc.copy_span}: a fact (a key of up to 5 tokens, the separator "
                            f"{rc.copy_separator!r} = up to {fmt.max_separator()} tokens, a value) needs >= "
                            f"{fmt.min_span()}")
    except ValueError as e:  # the format's text under the pair's tokenizer
        problems.append(f"residual.copy_separator / copy_values: {e}")
    except CheckpointError:
        pass  # the missing tokenizer is reported on its own
    return problems


def check_processes(cfg: RunConfig, process_count: int) -> None:
    """Settings that need one process, checked once jax.distributed is up (before any stage runs): the teacher pool
    and the fact-copy windows are made once, in one process's memory."""
    rc = cfg.residual
    if process_count > 1 and rc.steps > 0 and (rc.pool_windows or rc.copy_windows):
        names = [n for n in ("pool_windows", "copy_windows") if getattr(rc, n)]
        raise LaunchError(f"residual.{' and residual.'.join(names)} need one process (their pools are made once, in "
                          f"one process's memory); this run has {process_count}: set "
                          f"{' and '.join(f'--config.residual.{n}=0' for n in names)} or run on one process")


def make_mesh(cfg: RunConfig):
    """The ('data', 'model') mesh over every device of every process. With several processes the 'model' axis stays
    within one (default: all of a process's devices; data=1 means every device not used by 'model'): only
    data-parallel traffic crosses hosts, and each process holds whole models, so process 0 can evaluate alone
    (kvjax.distributed.local_view)."""
    import jax

    from kvjax.sharding import make_mesh as mesh_of
    data, model = cfg.mesh.data, cfg.mesh.model or None
    hint = (f"devices: {jax.device_count()} on {jax.process_count()} process(es); set --config.mesh.data / "
            "--config.mesh.model")
    if jax.process_count() > 1:
        if model is None:
            model = jax.local_device_count() if data == 1 else max(jax.device_count() // data, 1)
        if data == 1:
            data = jax.device_count() // model
        if jax.local_device_count() % model:
            raise LaunchError(f"mesh: model={model} must divide the {jax.local_device_count()} devices of each "
                              f"process (the model axis stays within a host) ({hint})")
    try:
        return mesh_of(data, model)
    except ValueError as e:
        raise LaunchError(f"mesh: {e} ({hint})")
