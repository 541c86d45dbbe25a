"""`python -m kvjax.serve --config=NAME [--map PATH] [--host H] [--port P] [--topology T] ...`: serve a run's map.

The same run configs as the main job (configs/NAME.py, --config.FIELD=VALUE overrides; default: the main job's). The map is the config's
finished run (its final map in output_dir, judged by output_dir/gate.json) or --map PATH (a kvjax.save_map
directory; its gate is PATH/../gate.json when there is one, or --gate FILE). When the gate failed, requests are served
by the target alone ("native_target"). Problems the user can fix are one message and exit status 2, before any
model is loaded: the flags, the config, the checkpoints' headers and the map are checked before JAX is imported (or
the process restarts under the allocator settings), so such a mistake is reported in well under a second.

A config whose `audio` evaluation is enabled (--config=toy_audio) also answers spoken chat requests (input_audio
parts; kvjax.serve.audio): the source's adapter (cfg.eval.audio.source_adapter) listens and the run's audio map
(OUTPUT_DIR/eval/audio/audio_map; the final text map, with a warning, when the run has none) translates its cache.
When the gate failed, the answerer's own adapter (cfg.eval.audio.target_adapter) listens instead (the native audio
path; unset or missing: spoken requests get a 400 naming the setting). The startup log and /v1/models say which.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kvjax import allocator
from kvjax.config_flags import ConfigFlagError, available_configs, build, parse_argv
from kvjax.run.config import DEFAULT_CONFIG, RunConfig  # DEFAULT_CONFIG: the main job's default run is the served one
from kvjax.run.layout import MAP_DIRS, final_arm
from kvjax.run.preflight import LaunchError, model_problems, resolve_models
from kvjax.serve.config import DRAFT_POLICIES, DRAFTERS, TOPOLOGIES, EngineConfig

log = logging.getLogger("kvjax.serve")
MANIFEST = "manifest.json"  # a saved map's (kvjax.mapper.artifact.MANIFEST; that module imports JAX)


class ServeError(Exception):
    """A problem the user can fix; the message names the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line in the command's own style (main prints it), not a usage dump
        raise ServeError(f"{message}; `python -m kvjax.serve --help` lists the flags")


def parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = _Parser(
        prog="python -m kvjax.serve", description="OpenAI-compatible server for a fitted map "
        "(source prefill -> map -> target decode). --config=NAME and --config.FIELD=VALUE as in python -m kvjax.launch "
        f"(configs: {', '.join(available_configs())}; default {DEFAULT_CONFIG}).")
    p.add_argument("--map", default="", help="a map directory (kvjax.save_map); default: the config's run directory")
    p.add_argument("--gate", default="", help="gate.json judging the map (default: beside the map's run)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--topology", choices=TOPOLOGIES, default=d.topology)
    p.add_argument("--slots", type=int, default=d.slots, help="requests decoding at once (serial: 1)")
    p.add_argument("--capacity", type=int, default=d.capacity, help="tokens per request: prompt + max_tokens")
    p.add_argument("--max-prefill-batch", type=int, default=d.max_prefill_batch)
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests before 429")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens_limit, help="largest max_tokens accepted")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request")
    p.add_argument("--prefill-devices", type=int, default=d.prefill_devices,
                   help="disaggregated: devices of the prefill pool (default all but one)")
    p.add_argument("--cpu-devices", type=int, default=2,
                   help="disaggregated on CPU: host devices to split into the pools (XLA_FLAGS)")
    p.add_argument("--prefix-cache-mb", type=float, default=d.prefix_cache_mb, metavar="MB",
                   help="host memory for a prefix cache of transferred caches: a prompt that starts with a cached "
                   "prefix runs the source and the map only on the rest (0: off)")
    p.add_argument("--prefix-block", type=int, default=d.prefix_block, metavar="TOKENS",
                   help="tokens per prefix-cache block (prefixes are reused in whole blocks)")
    p.add_argument("--max-step-tokens", type=int, default=d.max_step_tokens, metavar="N",
                   help="batched: chunked prefill, at most N prompt tokens read between two decode steps, so "
                   "decoding requests never wait for a whole long prompt (0: off)")
    g = p.add_argument_group("speculative decoding (docs/serving.md)")
    g.add_argument("--speculative", choices=DRAFTERS, default=d.speculative,
                   help="draft tokens for the target to verify, several per step where it pays: lookup (copies of "
                   "the request's own earlier text, no model), block (a block drafter, --drafter), combined (lookup "
                   "where the text repeats, the block drafter elsewhere); none: one token per step")
    g.add_argument("--draft-len", type=int, default=d.draft_len, metavar="G",
                   help="tokens drafted per round at most (default 16; block / combined: a block size the block "
                   "drafter was trained for); a round verifies fewer where the drafts are shorter")
    g.add_argument("--drafter", default=d.drafter, metavar="DIR",
                   help="block / combined: the block drafter's directory, trained for the answering model "
                   "(python -m launch.toy.drafter writes one)")
    g.add_argument("--draft-refine", type=int, default=d.draft_refine, metavar="N",
                   help="block / combined: the block drafter's refinement passes (kvjax.drafter.load_block_drafter "
                   "says what each costs and gives)")
    g.add_argument("--draft-context", type=int, default=d.draft_context, metavar="TOKENS",
                   help="block / combined: the prompt's last TOKENS whose target features start the drafter's "
                   "context")
    g.add_argument("--lookup-ngram", default="%d:%d" % d.lookup_ngram, metavar="MIN:MAX",
                   help="lookup / combined: the shortest and longest n-gram prompt lookup matches")
    g.add_argument("--min-match", type=int, default=d.min_match, metavar="N",
                   help="combined: the shortest recurring n-gram whose copy is drafted instead of the block "
                   "drafter's draft")
    g.add_argument("--draft-policy", choices=DRAFT_POLICIES, default=d.draft_policy,
                   help="auto: a step drafts where the measured costs say it pays (never slower than plain "
                   "decoding by more than noise); always: every step drafts")
    p.add_argument("--warmup", default="0", metavar="[MIN:]MAX",
                   help="compile every prefill shape for prompts of MIN..MAX tokens before serving (0: lazily)")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="accept POST /admin/faults (fault tooling on localhost; never in production)")
    p.add_argument("--log-level", default="info")
    return p


def final_map_dir(cfg: RunConfig) -> str:
    return os.path.join(cfg.output_dir, MAP_DIRS[final_arm(cfg)])


def locate(cfg: RunConfig, name: str, map_arg: str, gate_arg: str) -> tuple[str, str]:
    """(map directory, gate file or '') with a message naming the command to run when there is none."""
    run = f"python -m kvjax.launch --config={name}"
    if map_arg:
        if not os.path.isfile(os.path.join(map_arg, MANIFEST)):
            raise ServeError(f"--map {map_arg}: not a map directory (no {MANIFEST}); pass a directory written by "
                             f"kvjax.save_map, e.g. {final_map_dir(cfg)} after `{run}`")
        beside = os.path.join(os.path.dirname(os.path.abspath(map_arg)), "gate.json")
        gate = gate_arg or (beside if os.path.isfile(beside) else "")
    else:
        path = final_map_dir(cfg)
        gate = gate_arg or os.path.join(cfg.output_dir, "gate.json")
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            raise ServeError(f"config {name!r} has no fitted map at {path}: run `{run}` first (it fits the map and "
                             "judges it), or pass --map PATH (a kvjax.save_map directory)")
        if not os.path.isfile(gate):
            raise ServeError(f"the run in {cfg.output_dir} has not finished (no gate.json, which says whether the "
                             f"map may serve): run `{run}` to finish it, or pass --map {path} to serve it ungated")
    if gate_arg and not os.path.isfile(gate_arg):
        raise ServeError(f"--gate {gate_arg}: no such file (python -m kvjax.launch writes OUTPUT_DIR/gate.json)")
    return path if not map_arg else map_arg, gate


def parse(argv: list[str]):
    """(config, args, engine settings, map directory, gate file), every check that needs no JAX passed: the flags,
    the config's fields and types, the checkpoints' headers, the engine settings, the map and its gate."""
    name, overrides, rest = parse_argv(argv)
    args = parser().parse_args(rest)
    cfg = resolve_models(build(name or DEFAULT_CONFIG, overrides, RunConfig))
    problems = []
    try:
        lo, _, hi = args.lookup_ngram.partition(":")
        ngram = (int(lo), int(hi))
    except ValueError:
        problems.append(f"--lookup-ngram {args.lookup_ngram}: give MIN:MAX (e.g. 1:3)")
        ngram = EngineConfig.lookup_ngram
    engine = EngineConfig(topology=args.topology, slots=args.slots, capacity=args.capacity,
                          max_prefill_batch=args.max_prefill_batch, max_queue=args.max_queue,
                          max_tokens_limit=args.max_tokens, request_timeout=args.request_timeout,
                          prefill_devices=args.prefill_devices, prefix_cache_mb=args.prefix_cache_mb,
                          prefix_block=args.prefix_block, max_step_tokens=args.max_step_tokens,
                          speculative=args.speculative, draft_len=args.draft_len, drafter=args.drafter,
                          draft_refine=args.draft_refine, draft_context=args.draft_context, lookup_ngram=ngram,
                          min_match=args.min_match, draft_policy=args.draft_policy)
    problems += model_problems(cfg) + engine.problems() + audio_problems(cfg) + drafter_problems(engine)
    try:
        lo, _, hi = args.warmup.rpartition(":")
        args.warmup = (int(lo or 2), int(hi))
    except ValueError:
        problems.append(f"--warmup {args.warmup}: give MAX or MIN:MAX prompt tokens")
    if not 1 <= args.port <= 65535:
        problems.append(f"--port {args.port}: use 1..65535")
    if problems:
        raise ServeError("; ".join(problems))
    map_dir, gate = locate(cfg, name or DEFAULT_CONFIG, args.map, args.gate)
    return cfg, args, engine, map_dir, gate


def drafter_problems(engine: EngineConfig) -> list[str]:
    """The block drafter's directory and block size, checked before JAX starts (its fit to the answering model is
    checked when it loads: kvjax.drafter.DrafterError)."""
    if engine.speculative not in ("block", "combined") or not engine.drafter:
        return []
    manifest = os.path.join(engine.drafter, "manifest.json")  # kvjax.drafter.io.MANIFEST (that module imports JAX)
    if not os.path.isfile(manifest):
        return [f"--drafter {engine.drafter}: not a block drafter directory (no manifest.json); pass one written by "
                "kvjax.drafter.save_drafter (python -m launch.toy.drafter trains one), e.g. checkpoints/toy/drafter "
                "for a config whose answering model is the toy source"]
    try:
        with open(manifest) as f:
            sizes = [int(b) for b in json.load(f)["block_sizes"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"--drafter {engine.drafter}: unreadable manifest.json ({type(e).__name__}: {e}); retrain the drafter"]
    if engine.rounds_draft not in sizes:
        return [f"--draft-len {engine.rounds_draft}: the block drafter in {engine.drafter} was trained for blocks of "
                f"{sizes} tokens; pass one of them"]
    return []


def audio_problems(cfg: RunConfig) -> list[str]:
    """An audio config's adapter, checked before JAX starts."""
    ec = getattr(cfg.eval, "audio", None)
    if ec is None or not ec.enabled or os.path.isfile(os.path.join(ec.source_adapter, "config.json")):
        return []
    return [f"eval.audio.source_adapter: {ec.source_adapter!r} is not an audio adapter directory (config.json in "
            "Ultravox's layout; the toy's: python -m launch.toy.speech_train), and spoken requests need it: pass "
            "--config.eval.audio.source_adapter=DIR, or serve text only with --config.eval.audio.enabled=false"]


def serving_mesh(cfg: RunConfig, engine_cfg: EngineConfig):
    """The mesh the batched server shards its models over, as the job does (--config.mesh.data / .model; model 0:
    every device data leaves). On CPU, whose devices are one host split in pieces, the default is one device, and a
    mesh only when --config.mesh asks for one. None: one device."""
    import jax

    from kvjax.sharding import make_mesh
    data, model = cfg.mesh.data, cfg.mesh.model
    asked = data > 1 or model > 0
    if engine_cfg.topology != "batched" or (jax.default_backend() == "cpu" and not asked):
        return None
    try:
        mesh = make_mesh(data, model or None, jax.devices()[: data * model] if model else None)
    except ValueError as e:
        raise ServeError(f"--config.mesh.data={data} --config.mesh.model={model}: {e}") from None
    return mesh if mesh.size > 1 else None


def check_fits(cfg: RunConfig, engine_cfg: EngineConfig, mesh) -> None:
    """Refuse, before any weights are read, a server whose weights and caches exceed its devices' memory
    (--config.mesh.device_memory_gb, else what the device reports; a CPU device reports none and is not checked)."""
    import jax
    import jax.numpy as jnp

    from kvjax.hf import load_hf_config
    from kvjax.serve.placement import Placement, held
    place = Placement(mesh if mesh is not None else jax.devices()[0])
    limit = cfg.mesh.device_memory_gb * 1e9 or place.memory()
    if not limit:
        return
    # the split path holds both models; the gate's verdict is read later, so the check assumes the larger need
    models = {"target": (load_hf_config(cfg.target.path), jnp.dtype(cfg.target.dtype)),
              "source": (load_hf_config(cfg.source.path), jnp.dtype(cfg.source.dtype))}
    need = held(place, models, engine_cfg.slots, engine_cfg.capacity, engine_cfg.max_prefill_batch)
    total = sum(need.values())
    if total > limit:
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in need.items())
        raise ServeError(
            f"{engine_cfg.slots} slots x {engine_cfg.capacity} tokens need at least {total / 1e9:.2f} GB per device "
            f"({parts}), over the {limit / 1e9:.2f} GB of each of the {place.mesh.size if place.mesh else 1} "
            f"device(s) of {place} (nothing was loaded): use fewer --slots, a smaller --capacity or "
            "--max-prefill-batch, or more devices on the 'model' axis (--config.mesh.model); "
            f"python -m kvjax.plan --config={cfg.name} --serve --topology=GEN:SHAPE compiles the server's programs "
            "and gives the most slots per context")


def build_server(cfg: RunConfig, args, engine_cfg: EngineConfig, map_dir: str, gate_path: str):
    """Load the models, map, gate and tokenizer; an Engine (started) and its Server."""
    import jax.numpy as jnp

    import kvjax
    from kvjax.serve.app import Server
    from kvjax.serve.chat import load_chat_template
    from kvjax.serve.engine import Engine
    mesh = serving_mesh(cfg, engine_cfg)
    if mesh is not None:
        log.info("models sharded over %d devices: mesh data=%d x model=%d", mesh.size, *mesh.devices.shape)
    check_fits(cfg, engine_cfg, mesh)

    def load(mc):  # straight to the devices that hold each tensor's shard (a 32B model does not fit one)
        from kvjax.hf import load_hf_config
        from kvjax.models.params import param_shardings
        shardings = param_shardings(load_hf_config(mc.path), mesh) if mesh is not None else None
        return kvjax.load_hf(mc.path, dtype=jnp.dtype(mc.dtype), shardings=shardings)
    source, target = load(cfg.source), load(cfg.target)
    kvmap = kvjax.load_map(map_dir, source.cfg, target.cfg)
    split, reason = True, ""
    if gate_path:
        gate = kvjax.load_gate(gate_path)
        split = gate.passed
        reason = "" if split else f"the map failed its quality gate ({gate.summary()})"
    else:
        log.warning("no gate result for %s: serving the split path ungated", map_dir)
    if not split:
        log.warning("%s: serving the native target path", reason)
    tokenizer = kvjax.load_tokenizer(cfg.target.path)
    audio, audio_reason = None, ""
    if cfg.eval.audio.enabled:  # the split audio path (source's adapter + audio map), or the answerer's own
        from kvjax.serve import audio as spoken
        if split:
            audio = spoken.load(cfg, source, target.cfg, tokenizer, kvmap)
        else:
            audio, why = spoken.load_native(cfg, source, target, tokenizer)
            audio_reason = f"{reason}, so the target answers alone, and {why}" if why else ""
        if audio is not None:
            log.info("spoken requests: %s", audio.describe())
        else:
            log.warning("spoken requests are refused (400): %s", audio_reason)
    engine = Engine(tuple(source), tuple(target), kvmap, tokenizer, engine_cfg, split=split, reason=reason,
                    audio=audio, audio_reason=audio_reason, mesh=mesh)
    if args.warmup[1]:
        log.info("warming up (compiling prefill for %d..%d-token prompts) ...", *args.warmup)
        log.info("warm-up done in %.1fs", engine.warmup(args.warmup[1], args.warmup[0]))
    engine.start()
    return engine, Server(engine, cfg.name, load_chat_template(cfg.target.path), args.enable_fault_injection)


def main(argv: list[str] | None = None, restart: bool = False) -> int:
    """Serve until stopped; 2 for a problem found before serving. `restart` (the entry point's): once the command
    line passed its checks, restart the process under the allocator settings (kvjax.allocator.reexec), before JAX
    starts."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        applied = allocator.tune()  # before XLA starts its threads (kvjax.allocator says why)
    except ValueError as e:  # a bad KVJAX_MALLOC
        print(f"kvjax.serve: error: {e}", file=sys.stderr)
        return 2
    try:
        cfg, args, engine_cfg, map_dir, gate = parse(argv)
    except (ServeError, ConfigFlagError, LaunchError) as e:
        print(f"kvjax.serve: error: {e}", file=sys.stderr)
        return 2
    if restart:
        allocator.reexec()  # huge pages for the weights: a restart, once (kvjax.allocator says why)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    if engine_cfg.topology == "disaggregated" and "xla_force_host_platform_device_count" not in \
            os.environ.get("XLA_FLAGS", "") and os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
        # on CPU, split the host into devices so each pool has its own (before JAX starts)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    log.info("host allocator: %s", applied)
    import uvicorn

    from kvjax.hf import CheckpointError
    from kvjax.models.config import ConfigError
    try:
        engine, server = build_server(cfg, args, engine_cfg, map_dir, gate)
    except (ServeError, ValueError, CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"kvjax.serve: error: {e}", file=sys.stderr)
        return 2
    log.info("serving %s (%s path, %s topology, %d slots x %d tokens) on http://%s:%d", cfg.name, engine.path,
             engine.config.topology, engine.config.slots, engine.config.capacity, args.host, args.port)
    if engine.prefix is not None:
        log.info("prefix cache: %.0f MB of host memory, blocks of %d tokens", engine_cfg.prefix_cache_mb,
                 engine_cfg.prefix_block)
    if engine_cfg.max_step_tokens:
        log.info("chunked prefill: at most %d prompt tokens between decode steps", engine_cfg.max_step_tokens)
    if engine_cfg.drafting:
        log.info("speculative decoding: %s drafter, %d tokens a round, %s policy", engine_cfg.speculative,
                 engine_cfg.rounds_draft, engine_cfg.draft_policy)
    try:
        uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
