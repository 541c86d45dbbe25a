"""`python -m kvjax.launch [--config=NAME] [--config.FIELD=VALUE ...] [--redo=STAGE,...]`: the end-to-end job.

The source model reads, a fitted map translates its KV cache, the target model answers; this job fits the map and
measures what the seed paper reports. Stages, each skipped when its artifact already exists in the run directory
(config.output_dir) with the same settings:

  calibrate   tokenize the calibration text; draw calibration, lambda-selection and held-out windows   data/
  ridge       run both models over the calibration windows, ridge per target layer (K and V)           map_ridge/
  residual    train the residual on source-teacher KL (resumable: orbax checkpoints in residual/)     map/
  evaluate    distances, kl, mc, retrieval, throughput (each its own stage, each selectable)          eval/*.json
  report      metrics.json, report.md, charts, gate.json                                              (run dir)

NAME is configs/NAME.py (default: toy_pruned_quick, the shipped source and pruned target on CPU). --redo
recomputes the named stages and every stage after them. `--help` lists every config field with its value.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

from kvjax import allocator as kvjax_allocator
from kvjax.config_flags import ConfigFlagError, build, describe_config, parse_argv, to_dict
from kvjax.eval import suite
from kvjax.preflight import LaunchError, check_processes, make_mesh, resolve_models, validate
from kvjax.run_config import RunConfig
from kvjax.stages import RunDir, Stage, StageConflict, model_identity, read_json, write_json

log = logging.getLogger("kvjax.launch")
DEFAULT_CONFIG = "toy_pruned_quick"  # the shipped pair on which the map helps, in minutes on 2 cores
EVALS = suite.NAMES  # the evaluation registry (kvjax.eval.suite), one stage each
STAGES = ("calibrate", "ridge", "residual", "perhead", *EVALS, "report")


# ---- stages ------------------------------------------------------------------------------------------------------

def fitted_maps(cfg: RunConfig) -> tuple[str, ...]:
    """The maps this run fits, each named after the stage that fits it (and its arm in kvjax.eval.arms), the final
    map last: the one the gate judges and throughput times."""
    peers = ("perhead",) if cfg.peers.perhead_topk > 0 else ()  # before the run's own maps: the final one is last
    return (*peers, "ridge", "residual") if cfg.residual.steps > 0 else (*peers, "ridge")


def final_arm(cfg: RunConfig) -> str:
    return fitted_maps(cfg)[-1]


def plan(cfg: RunConfig) -> dict[str, Stage]:
    """Every stage with the settings it depends on (hashes are known before any work)."""
    models = {role: {"path": getattr(cfg, role).path, "dtype": getattr(cfg, role).dtype,
                     "identity": model_identity(getattr(cfg, role).path)} for role in ("source", "target")}
    d = to_dict(cfg)
    calibrate = Stage("calibrate", {"data": d["data"], "tokenizer": models["target"]["identity"].get("tokenizer.json"),
                                    "windows": {k: d["map"][k] for k in ("calib_windows", "select_windows",
                                                                          "window_len")},
                                    "seed": cfg.seed}, [], ["data"])
    ridge = Stage("ridge", {"models": models, "map": d["map"], "seed": cfg.seed}, [calibrate], ["map_ridge"])
    stages = {"calibrate": calibrate, "ridge": ridge}
    final = ridge
    if cfg.residual.steps > 0:
        final = stages["residual"] = Stage("residual", {"residual": cfg.residual.hashed()}, [ridge],
                                           ["map", "residual"])
    peers = []
    if cfg.peers.perhead_topk > 0:  # the per-head ridge peer (kvjax.mapper.perhead), on the same calibration windows
        peers.append(Stage("perhead", {"models": models, "peers": d["peers"], "batch_size": cfg.map.batch_size},
                           [calibrate], ["map_perhead"]))
        stages["perhead"] = peers[-1]
    evals = []
    for ev in suite.EVALUATIONS:
        if getattr(cfg.eval, ev.name).enabled:
            stages[ev.name] = Stage(ev.name, suite.stage_settings(ev, cfg, fitted_maps(cfg)),
                                    [calibrate, ridge, final, *peers], [f"eval/{ev.name}.json"])
            evals.append(stages[ev.name])
    stages["report"] = Stage("report", {"gate": cfg.gate.hashed(), "bootstrap": cfg.eval.bootstrap,
                                        "names": [cfg.source.name, cfg.target.name]},
                             evals + [final], ["report.md", "metrics.json", "gate.json"])
    return stages


class Job:
    """The stages of one run. In a multi-process run every process builds a Job: all of them run the data-parallel
    stages (COLLECTIVE) on the mesh over every device; process 0 alone runs the others on its own devices (`local`)
    and writes the run directory's shared files, while the others wait. A Job asks JAX which process it is: start
    jax.distributed (kvjax.distributed.initialize, as main() does) before building one."""

    def __init__(self, cfg: RunConfig, redo: tuple[str, ...] = (), step_timeout: float = 0.0):
        import jax

        from kvjax import distributed
        self.cfg = cfg
        self.run = RunDir(cfg.output_dir, writer=jax.process_index() == 0, sync=distributed.wait_all)
        self.stages = plan(cfg)
        self.redo = redo
        self.step_timeout = step_timeout  # kvjax.distributed.Watchdog over the collective stages (0: off)
        self._models = {}  # scope ("global" / "local") -> (source, target)
        self._maps = {}
        self._mesh = None
        self._local = False  # running a stage on this process's devices only (multi-process: process 0 alone)
        self.seconds: dict[str, float] = {}
        self.reused: list[str] = []
        self._checked = False

    COLLECTIVE = ("ridge", "residual")  # the data-parallel stages: every process takes part

    # -- shared resources, loaded on first use --

    def mesh(self):
        """The mesh the current stage runs on: every device of every process, or in a stage process 0 runs alone,
        its own part of that mesh."""
        import jax
        if self._mesh is None:
            self._mesh = make_mesh(self.cfg)
        return self._mesh.local_mesh if self._local and jax.process_count() > 1 else self._mesh

    def parallel_mesh(self):
        """The mesh for the mapper's data-parallel paths (fit_map / train_residual mesh=), None on one device."""
        return self.mesh() if self.mesh().size > 1 else None

    def models(self):
        import jax
        scope = "local" if self._local and jax.process_count() > 1 else "global"
        if scope not in self._models:
            if "global" in self._models:  # the same buffers, seen from this process alone
                from kvjax.distributed import local_view
                self._models[scope] = local_view(self._models["global"], self._mesh)
            else:
                self._models[scope] = self._load_models()
        return self._models[scope]

    def _load_models(self):
        import jax.numpy as jnp

        import kvjax
        from kvjax.models.params import abstract_params, param_axes
        from kvjax.sharding import tree_shardings
        out = []
        for role in ("source", "target"):
            mc = getattr(self.cfg, role)
            mcfg = kvjax.load_hf_config(mc.path)
            shardings = tree_shardings(abstract_params(mcfg), param_axes(mcfg), self.mesh())
            t0 = time.perf_counter()
            out.append(kvjax.load_hf(mc.path, dtype=jnp.dtype(mc.dtype), shardings=shardings))
            log.info("loaded %s %s (%.1fM params, %d layers, %d kv heads x %d) in %.1fs", role, mc.path,
                     mcfg.num_params() / 1e6, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                     time.perf_counter() - t0)
        return tuple(out)

    def tokenizer(self):
        import kvjax
        return kvjax.load_tokenizer(self.cfg.target.path)

    def data(self, name: str):
        import numpy as np
        return np.load(self.run.path("data", f"{name}.npy"), mmap_mode="r")

    def replicated(self, tree):
        """`tree` replicated over the current mesh (which may span processes: every process passes the same)."""
        from kvjax.distributed import replicate
        mesh = self.mesh()
        return tree if mesh.size == 1 else replicate(tree, mesh)

    def map(self, name: str):
        """A map by arm name (ridge, residual: fitted by this run; direct, raw: the untrained injection), replicated
        over the current mesh (execute() empties the cache when the mesh changes)."""
        if name not in self._maps:
            import kvjax
            from kvjax.eval.arms import injection_map
            source, target = self.models()
            if name in ("direct", "raw"):
                kvmap = self.replicated(injection_map(source[0], target[0]))
            else:
                from jax.sharding import NamedSharding, PartitionSpec
                where = {"ridge": "map_ridge", "perhead": "map_perhead"}.get(name, "map")
                kvmap = kvjax.load_map(self.run.path(where), source[0], target[0],
                                       sharding=NamedSharding(self.mesh(), PartitionSpec()))
            self._maps[name] = kvmap
        return self._maps[name]

    # -- the pipeline --

    def check(self) -> None:
        """Apply --redo, then make sure no finished stage conflicts with these settings (before any work)."""
        if self._checked:
            return
        self._checked = True
        names = list(self.stages)
        for r in self.redo:
            if r not in self.stages:
                raise LaunchError(f"--redo={r}: not a stage of this config; stages: {', '.join(names)}")
            for later in names[names.index(r):]:
                if later == r or r in ("calibrate", "ridge", "residual") or later == "report":
                    self.run.forget(self.stages[later])
        for stage in self.stages.values():
            try:
                self.run.done(stage)
            except StageConflict as e:
                raise LaunchError(str(e)) from None

    def execute(self) -> dict:
        import jax
        from tqdm import tqdm

        from kvjax import distributed
        self.check()
        if self.run.writer:
            os.makedirs(self.run.root, exist_ok=True)
            write_json(self.run.path("config.json"), to_dict(self.cfg))
        # every process decides what to reuse from the same markers, read before process 0 writes a new one
        done = {name: self.run.done(stage) for name, stage in self.stages.items()}
        self.run.sync("plan read")
        t_start = time.perf_counter()
        for name, stage in tqdm(self.stages.items(), desc="stages", unit="stage", leave=False,
                                disable=not self.run.writer):
            if done[name]:
                self.reused.append(name)
                log.info("stage %-10s reused (%s)", name, self.run.marker(stage))
                continue
            collective = name in self.COLLECTIVE
            if collective or self.run.writer:
                if self._local == collective and jax.process_count() > 1:
                    self._maps.clear()  # maps placed on the other mesh
                self._local = not collective
                log.info("stage %-10s running%s", name, "" if jax.process_count() == 1 else
                         f" on {'all' if collective else 'the'} {self.mesh().size} devices of "
                         f"{'every process' if collective else 'process 0'}")
                t0, c0 = time.perf_counter(), time.process_time()
                with jax.set_mesh(self.mesh()), distributed.Watchdog(self.step_timeout if collective else 0):
                    getattr(self, f"stage_{name}" if hasattr(self, f"stage_{name}") else "stage_eval")(stage)
                self.seconds[name] = time.perf_counter() - t0
                cpu = time.process_time() - c0
                self.run.finish(stage, self.seconds[name], cpu)
                log.info("stage %-10s done in %.1fs (%.1f CPU s)", name, self.seconds[name], cpu)
            else:
                log.info("stage %-10s runs on process 0; waiting for it", name)
            self.run.sync(f"stage {name}")
        total = time.perf_counter() - t_start
        if not os.path.isfile(self.run.path("gate.json")):
            raise LaunchError(f"{self.run.path('gate.json')} is missing although the report stage is marked done; "
                              "pass --redo=report")
        gate = read_json(self.run.path("gate.json"))
        log.info("finished in %.1fs (%d stages run, %d reused); report: %s; quality gate: %s", total,
                 len(self.seconds), len(self.reused), self.run.path("report.md"), "PASS" if gate["passed"] else "FAIL")
        return {"seconds": total, "ran": list(self.seconds), "reused": self.reused, "gate": gate}

    def stage_calibrate(self, stage: Stage) -> None:
        import numpy as np

        from kvjax import corpus
        from kvjax.hf import load_hf_config
        from kvjax.windows import consecutive, sample
        cfg, d = self.cfg, self.cfg.data
        tcfg = load_hf_config(cfg.target.path)
        eos = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else (tcfg.pad_token_id or 0)
        tok = self.tokenizer()
        train = corpus.read_tokens(d.train_text, tok, eos, d.max_train_tokens, d.manifest, d.text_field)
        rc = cfg.residual
        copies = rc.copy_len + rc.copy_span if rc.copy_windows else 0  # the fact-copy windows' length
        need = max(cfg.map.window_len, rc.prefix_len + rc.cont_len, copies) + 2
        if len(train) < 2 * need:
            raise LaunchError(f"data.train_text gave {len(train)} tokens; calibration and residual windows need at "
                              f"least {2 * need}; add text or raise data.max_train_tokens")
        calib = sample(train, cfg.map.calib_windows, cfg.map.window_len, seed=cfg.seed + 1)
        select = sample(train, cfg.map.select_windows, cfg.map.window_len, seed=cfg.seed + 2)
        if d.heldout_windows:
            heldout = np.asarray(np.load(d.heldout_windows), np.int32)
        else:
            flat = corpus.read_tokens(d.heldout_text, tok, eos, d.max_heldout_tokens, d.manifest, d.text_field)
            if len(flat) < d.heldout_window_len:
                raise LaunchError(f"data.heldout_text gave {len(flat)} tokens, less than one held-out window of "
                                  f"{d.heldout_window_len}; add text or lower data.heldout_window_len")
            heldout = consecutive(flat, d.heldout_window_len)
        for name, arr in (("train text", train), ("held-out windows", heldout)):
            if arr.min() < 0 or arr.max() >= tcfg.vocab_size:
                raise LaunchError(f"{name} hold token ids outside the vocabulary [0, {tcfg.vocab_size}): "
                                  "they were made with another tokenizer")
        out = self.run.path("data")
        tmp = out + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        for name, arr in (("train_tokens", train), ("calib", calib), ("select", select), ("heldout", heldout)):
            np.save(os.path.join(tmp, f"{name}.npy"), np.asarray(arr, np.int32))
        write_json(os.path.join(tmp, "data.json"), {
            "train_text": list(d.train_text), "train_tokens": int(len(train)), "calib_windows": list(calib.shape),
            "select_windows": list(select.shape), "heldout_windows": list(heldout.shape),
            "heldout_from": d.heldout_windows or list(d.heldout_text),
            "sha256": {"train": corpus.sha256(train), "calib": corpus.sha256(calib), "heldout": corpus.sha256(heldout)}})
        _replace_dir(tmp, out)
        log.info("calibration text: %d tokens from %s; calib %s, select %s, held-out windows %s", len(train),
                 list(d.train_text), calib.shape, select.shape, heldout.shape)

    def stage_ridge(self, stage: Stage) -> None:
        import numpy as np

        import kvjax
        cfg = self.cfg
        source, target = self.models()
        pairing = "depth" if cfg.map.pairing == "depth" else int(cfg.map.pairing[3:])
        calib, select = np.asarray(self.data("calib")), np.asarray(self.data("select"))
        kvmap, report = kvjax.fit_map(source, target, calib, select, pairing=pairing, rank=cfg.map.rank,
                                      residual_rank=cfg.map.residual_rank, batch_size=cfg.map.batch_size,
                                      seed=cfg.seed, mesh=self.parallel_mesh(),
                                      tokenizers=tuple(kvjax.hf.tokenizer_fingerprint(m.path)
                                                       for m in (cfg.source, cfg.target)))
        data = read_json(self.run.path("data", "data.json"))
        info = {"source": cfg.source.path, "target": cfg.target.path, "config": cfg.name,
                "calib_sha256": data["sha256"]["calib"], "calib_tokens": report["calib_tokens"],
                "heldout_tokens": report["heldout_tokens"], "pairing": report["pairing"], "rank": cfg.map.rank,
                "lambdas": [[r["key"]["lambda"], r["value"]["lambda"]] for r in report["layers"]],
                "heldout_r2": [[r["key"]["heldout_r2"], r["value"]["heldout_r2"]] for r in report["layers"]],
                "residual_steps": 0}
        kvjax.save_map(self.run.path("map_ridge"), kvmap, info=info)
        log.info("ridge: pairing %s, held-out R^2 (key, value) per layer %s", report["pairing"],
                 [[round(x, 3) for x in r] for r in info["heldout_r2"]])

    def stage_residual(self, stage: Stage) -> None:
        import numpy as np

        import kvjax
        from kvjax.mapper.artifact import read_manifest
        source, target = self.models()
        workdir = self.run.path("residual")
        self.run.claim_workdir(stage, workdir)
        ridge = self.map("ridge")
        kvmap, history = kvjax.train_residual(ridge, source, target, np.asarray(self.data("train_tokens")),
                                              self.cfg.residual, workdir=workdir, mesh=self.parallel_mesh(),
                                              tokenizer=self.tokenizer())
        info = dict(read_manifest(self.run.path("map_ridge"))["info"], residual_steps=self.cfg.residual.steps,
                    residual=dataclasses.asdict(self.cfg.residual))
        kvjax.save_map(self.run.path("map"), kvmap, info=info)
        self._maps.pop("residual", None)
        if history:
            log.info("residual: training KL %.4f -> %.4f over steps %d..%d", history[0]["kl"], history[-1]["kl"],
                     history[0]["step"], history[-1]["step"])

    def stage_perhead(self, stage: Stage) -> None:
        import numpy as np

        import kvjax
        from kvjax.mapper.perhead import fit_perhead
        source, target = self.models()
        peers = self.cfg.peers
        kvmap, report = fit_perhead(source, target, np.asarray(self.data("calib")), k=peers.perhead_topk,
                                    lam=peers.perhead_lambda, batch_size=self.cfg.map.batch_size)
        info = {"source": self.cfg.source.path, "target": self.cfg.target.path, "config": self.cfg.name,
                "peer": "per-head ridge (Heo et al.)", **report}
        kvjax.save_map(self.run.path("map_perhead"), kvmap, info=info)
        log.info("perhead: top-%d source layers per head, lambda %g, pairing (union per layer) %s, %d bytes, fit "
                 "%.1fs", peers.perhead_topk, peers.perhead_lambda, report["pairing"], report["size_bytes"],
                 report["fit_seconds"])

    def map_costs(self, stage_seconds: dict) -> dict:
        """Per fitted map: its size in bytes and the wall seconds of the stages that fitted it (the residual's
        include the ridge it starts from)."""
        from kvjax.mapper.artifact import read_manifest
        out = {}
        for name in fitted_maps(self.cfg):
            seconds = stage_seconds.get(name) or 0.0
            if name == "residual":
                seconds += stage_seconds.get("ridge") or 0.0
            out[name] = {"size_bytes": map_size_bytes(read_manifest(self.run.path(MAP_DIRS[name])), self.map(name),
                                                      name), "fit_seconds": seconds}
        return out

    def stage_eval(self, stage: Stage) -> None:
        """One evaluation of the registry: its record to eval/NAME.json."""
        import numpy as np
        source, target = self.models()
        ctx = suite.EvalContext(cfg=self.cfg, source=source, target=target, map=self.map,
                                fitted=fitted_maps(self.cfg), heldout=np.asarray(self.data("heldout")),
                                tokenizer=self.tokenizer)
        write_json(self.run.path("eval", f"{stage.name}.json"), suite.run(suite.BY_NAME[stage.name], self.cfg, ctx))

    def stage_report(self, stage: Stage) -> None:
        from kvjax.gate import save_gate
        cfg = self.cfg
        records = {name: read_json(self.run.path("eval", f"{name}.json")) for name in EVALS if name in self.stages}
        final = final_arm(cfg)
        metrics = suite.build_metrics(records, self.run_info(), cfg.eval.bootstrap, final)
        gate = suite.evaluate_gate(metrics, cfg.gate, final)
        metrics["gate"] = gate.to_json()
        drawn = suite.draw_charts(metrics, self.run.root, cfg.source.name, cfg.target.name)
        metrics["run"]["charts"] = drawn
        write_json(self.run.path("metrics.json"), metrics)
        save_gate(self.run.path("gate.json"), gate)
        text = suite.render_report(metrics, drawn)
        tmp = self.run.path("report.md.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.run.path("report.md"))
        log.info("quality gate: %s", gate.summary())

    def run_info(self) -> dict:
        import jax

        import kvjax
        from kvjax.mapper.artifact import read_manifest
        cfg = self.cfg
        manifest = read_manifest(self.run.path(self.stages[final_arm(cfg)].outputs[0]))  # the final map's directory
        data = read_json(self.run.path("data", "data.json"))
        info = {"config": cfg.name, "output_dir": cfg.output_dir, "settings": to_dict(cfg)}
        for role in ("source", "target"):
            mc = getattr(cfg, role)
            mcfg = kvjax.load_hf_config(mc.path)
            info[role] = {"name": mc.name, "path": mc.path, "dtype": mc.dtype, "params_m": mcfg.num_params() / 1e6,
                          "layers": mcfg.num_layers, "kv_heads": mcfg.num_kv_heads, "head_dim": mcfg.head_dim,
                          "fingerprint": mcfg.fingerprint()}
        mi = manifest["info"]
        info["map"] = {"pairing": mi["pairing"], "rank": mi["rank"], "lambdas": mi["lambdas"],
                       "heldout_r2": mi["heldout_r2"], "residual_rank": manifest["spec"]["residual_rank"],
                       "residual_steps": mi.get("residual_steps", 0),
                       "residual_context": manifest["layers"][0].get("context", 0), "final": final_arm(cfg)}
        info["data"] = {"train_text": data["train_text"], "train_tokens": data["train_tokens"],
                        "calib_tokens": mi["calib_tokens"], "heldout_windows": data["heldout_windows"]}
        info["devices"] = f"{jax.device_count()} x {jax.devices()[0].platform} ({jax.devices()[0].device_kind})"
        info["versions"] = {"kvjax": kvjax.__version__, "jax": jax.__version__}
        info["stage_seconds"] = {name: self.run.seconds(s) or self.seconds.get(name, 0.0)
                                 for name, s in self.stages.items() if name != "report"}
        info["maps"] = self.map_costs(info["stage_seconds"])
        info["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        return info


MAP_DIRS = {"ridge": "map_ridge", "residual": "map", "perhead": "map_perhead"}


def map_size_bytes(manifest: dict, kvmap, name: str) -> int:
    """Bytes of a fitted map's float32 parameters as the method stores them: the ridge's mu, w_in, w_out, bias per
    target layer and kind; the residual adds its network (a context map's down_prev too); the per-head peer its
    per-head blocks (its manifest)."""
    if "size_bytes" in manifest["info"]:
        return int(manifest["info"]["size_bytes"])
    parts = ("mu", "w_in", "w_out", "bias") + (("down", "res_bias", "up", "down_prev") if name == "residual" else ())
    return int(sum(4 * getattr(m, p).size for m in (*kvmap.keys, *kvmap.values) for p in parts
                   if getattr(m, p) is not None))


def _replace_dir(tmp: str, out: str) -> None:
    import shutil
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


# ---- command line ------------------------------------------------------------------------------------------------

USAGE = """usage: python -m kvjax.launch [--config=NAME] [--config.FIELD=VALUE ...] [--redo=STAGE[,STAGE]]

  --config=NAME          configs/NAME.py (default: toy_pruned_quick); available: {configs}
  --config.a.b=VALUE     override a field (typed; tuples as comma-separated lists, None for optional fields)
  --redo=STAGE,...       recompute these stages and every stage after them; stages: {stages}

one to many hosts (every process runs this same command; the mesh is --config.mesh.data x --config.mesh.model):
  --distributed=auto|on|off  auto (default): start jax.distributed when a coordinator is given (flag or
                         JAX_COORDINATOR_ADDRESS, with JAX_NUM_PROCESSES and JAX_PROCESS_ID); on: always (SLURM,
                         Cloud TPU and MPI fill in what is not given); off: one process
  --coordinator=HOST:PORT --num_processes=N --process_id=I   instead of the JAX_* environment variables
  --heartbeat_timeout=S  a peer silent for S seconds counts as dead and ends the job (default 30)
  --init_timeout=S       seconds to wait for every process to connect (default 300)
  --step_timeout=S       exit (status 75) when no calibration batch or training step finishes for S seconds: a
                         peer that hangs alive (default 0: off; must exceed the first compile)
"""


def setup_logging(run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        # ours from an earlier call, or the bare stderr handler absl's first log line installs via basicConfig
        if getattr(h, "_kvjax_launch", False) or (type(h) is logging.StreamHandler
                                                   and h.stream in (sys.stderr, sys.__stderr__)):
            root.removeHandler(h)
            if getattr(h, "_kvjax_launch", False):
                h.close()
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(os.path.join(run_dir, "run.log"))):
        handler.setFormatter(fmt)
        handler._kvjax_launch = True
        root.addHandler(handler)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def parse(argv: list[str]) -> tuple[RunConfig | None, tuple[str, ...], bool]:
    """(resolved and validated config, stages to redo, help requested)."""
    from kvjax.config_flags import available_configs
    name, overrides, rest = parse_argv(argv)
    redo: tuple[str, ...] = ()
    help_ = False
    for arg in rest:
        if arg in ("-h", "--help"):
            help_ = True
        elif arg.startswith("--redo="):
            redo += tuple(s.strip() for s in arg[len("--redo="):].split(",") if s.strip())
        else:
            raise LaunchError(f"unknown argument {arg!r}\n" + USAGE.format(configs=", ".join(available_configs()),
                                                                         stages=", ".join(STAGES)))
    if "all" in redo:
        redo = ("calibrate",)
    cfg = build(name or DEFAULT_CONFIG, overrides, RunConfig)
    if help_:
        print(USAGE.format(configs=", ".join(available_configs()), stages=", ".join(STAGES)))
        print(f"config {name or DEFAULT_CONFIG}:\n{describe_config(cfg)}")
        return None, redo, True
    cfg = resolve_models(cfg)
    validate(cfg)
    return cfg, redo, False


def alias(forwarded: list[str], print_only: bool = False) -> int:
    """What an older entry point that became a set of flags of this job runs: the job with `forwarded`, or with
    `print_only` just the equivalent command line."""
    if print_only:
        print("python -m kvjax.launch " + " ".join(forwarded))
        return 0
    return main(forwarded)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        allocator = kvjax_allocator.tune()  # before XLA starts its threads (kvjax.allocator says why)
    except ValueError as e:  # a bad KVJAX_MALLOC
        print(f"kvjax.launch: error: {e}", file=sys.stderr)
        return 2
    from kvjax.corpus import CorpusError
    from kvjax.hf import CheckpointError
    from kvjax.models.config import ConfigError
    from kvjax.tensorfile import SafetensorsError
    # bad input whose message already says what to fix: print it alone, no traceback. Checkpoint weights are first
    # read inside a stage, before it writes anything, and a stage is marked done only once finished, so a rerun
    # after the fix redoes exactly that stage.
    bad_checkpoint = (CheckpointError, ConfigError, SafetensorsError)
    from kvjax import distributed
    try:
        try:
            flags, argv = distributed.split_launch_flags(argv)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        cfg, redo, help_ = parse(argv)
        if help_:
            return 0
        try:  # before anything touches a device; a no-op unless asked for (flags or JAX_COORDINATOR_ADDRESS)
            distributed.initialize_from_flags(flags)
        except ValueError as e:
            raise LaunchError(f"distributed: {e}") from None
        import jax
        check_processes(cfg, jax.process_count())
        job = Job(cfg, redo, step_timeout=flags.step_timeout)
        # conflicts with an earlier run are reported before anything is written; process 0 applies --redo first
        distributed.primary_first("check", job.check, LaunchError)
    except (ConfigFlagError, LaunchError, CorpusError, *bad_checkpoint) as e:
        print(f"kvjax.launch: error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.output_dir)
    import jax
    if jax.process_index() > 0:  # run.log is process 0's; the others log beside it
        root = logging.getLogger()
        for h in [h for h in root.handlers if isinstance(h, logging.FileHandler) and getattr(h, "_kvjax_launch", 0)]:
            mine = logging.FileHandler(os.path.join(cfg.output_dir, f"run.p{jax.process_index()}.log"))
            mine.setFormatter(h.formatter)
            mine._kvjax_launch = True
            root.removeHandler(h)
            h.close()
            root.addHandler(mine)
    log.info("kvjax.launch --config=%s -> %s (process %d of %d, %d devices: %s)", cfg.name, cfg.output_dir,
             jax.process_index(), jax.process_count(), jax.device_count(), jax.devices()[0].device_kind)
    log.info("host allocator: %s", allocator)
    log.info("settings:\n%s", describe_config(cfg))
    try:
        summary = job.execute()
    except (LaunchError, CorpusError, *bad_checkpoint) as e:
        log.error("%s", e)
        print(f"kvjax.launch: error: {e}", file=sys.stderr)
        return 1
    print(f"report: {os.path.join(cfg.output_dir, 'report.md')}  metrics: "
          f"{os.path.join(cfg.output_dir, 'metrics.json')}  quality gate: "
          f"{'PASS' if summary['gate']['passed'] else 'FAIL'}  ({summary['seconds']:.1f}s, "
          f"{len(summary['ran'])} stages run, {len(summary['reused'])} reused)")
    return 0


if __name__ == "__main__":
    kvjax_allocator.reexec()  # huge pages for the weights: a restart, before any work (kvjax.allocator says why)
    sys.exit(main())
