"""`python -m kvjax.launch [--config=NAME] [--config.FIELD=VALUE ...] [--redo=STAGE,...]`: the end-to-end job.

The source model reads, a fitted map translates its KV cache, the target model answers; this job fits the map and
measures what the method claims. Stages (kvjax.job), each skipped when its artifact already exists in the run
directory (config.output_dir) with the same settings:

  calibrate   tokenize the calibration text; draw calibration, lambda-selection and held-out windows   data/
  ridge       run both models over the calibration windows, ridge per target layer (K and V)           map_ridge/
  residual    train the residual on source-teacher KL (resumable: orbax checkpoints in residual/)     map/
  evaluate    distances, kl, mc, retrieval, throughput (each its own stage, each selectable)          eval/*.json
  report      metrics.json, report.md, charts, gate.json                                              (run dir)

NAME is configs/NAME.py (default: toy_pruned_quick, the shipped source and pruned target on CPU). --redo
recomputes the named stages and every stage after them. `--help` lists every config field with its value.

This module is the command only, and imports no JAX: it reads the flags and the config and runs the checks that
need no JAX (kvjax.run.preflight.check_fast: fields, types, paths, checkpoint headers), so such a mistake is reported
in well under a second with nothing written; then it locks the run directory (kvjax.job.lock: one job per
directory, a second one refused at once naming the holder), restarts under the allocator settings
(kvjax.allocator; the lock is kept across), sets up logging and hands over to kvjax.job.execute, which imports JAX,
runs the remaining checks (and the free space against what the stages will write: kvjax.job.disk) and the
stages. A write the disk refuses mid-stage (full, read-only) ends the job with one line (exit 1), the stage
unfinished; the same command resumes once the disk takes writes again.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys

from kvjax import allocator as kvjax_allocator
from kvjax.config_flags import (ConfigFlagError, LaunchFlags, available_configs, build, describe_config, parse_argv,
                                split_launch_flags)
from kvjax.job import lock as run_lock
from kvjax.run.config import DEFAULT_CONFIG, RunConfig
from kvjax.run.layout import STAGES
from kvjax.run.preflight import LaunchError, check_fast, resolve_models, validate

log = logging.getLogger("kvjax.launch")
FLAGS = ("--config", "--redo", "--help", *(f"--{f.name}" for f in dataclasses.fields(LaunchFlags)))


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



class _RunLog(logging.FileHandler):
    """The run directory's log file. A disk that refuses its writes (full, read-only) costs the file's lines, said
    once, not a traceback per line: the stage that hits the same disk reports it (kvjax.job.disk)."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not getattr(self, "_failed", False):
            self._failed = True
            print(f"kvjax.launch: warning: cannot write {self.baseFilename} ({sys.exc_info()[1]}); logging to "
                  "stderr only", file=sys.stderr)


def _not_a_refused_write(record: logging.LogRecord) -> bool:
    """On stderr, leave out a library's own report of a write the disk refused (orbax logs its background writes'
    errors with their tracebacks): the job's one line says it (kvjax.job.disk)."""
    from kvjax.job.disk import failed_write
    return not (record.exc_info and record.exc_info[1] is not None and failed_write(record.exc_info[1]))


def _unraisable(unraisable) -> None:
    """sys.unraisablehook, less one report: a callback posted to an asyncio loop already closed. TensorStore's writes
    that finish after orbax gave up on a checkpoint whose other writes failed (a full disk) report that, one
    traceback each, while the failure itself reaches the job (kvjax.job.disk)."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_name == "_check_closed"):
        sys.__unraisablehook__(unraisable)


def setup_logging(run_dir: str, process_index: int = 0) -> None:
    """Log to stderr and to the run directory: run.log (process 0) or run.pI.log (process I)."""
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
    name = "run.log" if process_index == 0 else f"run.p{process_index}.log"  # the others log beside process 0
    stderr = logging.StreamHandler(sys.stderr)
    stderr.addFilter(_not_a_refused_write)
    for handler in (stderr, _RunLog(os.path.join(run_dir, name), delay=True)):
        handler.setFormatter(fmt)
        handler._kvjax_launch = True
        root.addHandler(handler)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _unraisable


def read(argv: list[str], check=check_fast) -> tuple[RunConfig | None, tuple[str, ...]]:
    """(the config, its checkpoints resolved and passed by `check`, stages to redo); the config is None when --help
    was asked for (and printed). No JAX with the default `check`. Raises ConfigFlagError or LaunchError."""
    name, overrides, rest = parse_argv(argv)
    redo: tuple[str, ...] = ()
    help_ = False
    for arg in rest:
        if arg in ("-h", "--help"):
            help_ = True
        elif arg.startswith("--redo="):
            redo += tuple(s.strip() for s in arg[len("--redo="):].split(",") if s.strip())
        else:
            close = difflib.get_close_matches(arg.partition("=")[0], FLAGS, n=1)
            raise LaunchError(f"unknown argument {arg!r}{f' (did you mean {close[0]}?)' if close else ''}; the "
                              "flags are:\n" + USAGE.format(configs=", ".join(available_configs()),
                                                             stages=", ".join(STAGES)))
    if "all" in redo:
        redo = ("calibrate",)
    cfg = build(name or DEFAULT_CONFIG, overrides, RunConfig)
    if help_:
        print(USAGE.format(configs=", ".join(available_configs()), stages=", ".join(STAGES)))
        print(f"config {name or DEFAULT_CONFIG}:\n{describe_config(cfg)}")
        return None, redo
    cfg = resolve_models(cfg)
    check(cfg)
    return cfg, redo


def parse(argv: list[str]) -> tuple[RunConfig | None, tuple[str, ...], bool]:
    """(resolved and validated config, stages to redo, help requested): every check before any work."""
    cfg, redo = read(argv, validate)
    return cfg, redo, cfg is None


def _error(e: Exception, status: int) -> int:
    print(f"kvjax.launch: error: {e}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None, restart: bool = False) -> int:
    """Run the job: 0 once it finished (whichever the gate's verdict), 2 for a problem found before any work, 1 for
    one a stage found. `restart` (the entry point's): once the command line passed its checks, restart the process
    under the allocator settings (kvjax.allocator.reexec), before JAX starts."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        allocator = kvjax_allocator.tune()  # before XLA starts its threads (kvjax.allocator says why)
    except ValueError as e:  # a bad KVJAX_MALLOC
        return _error(e, 2)
    try:
        try:
            flags, argv = split_launch_flags(argv)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        cfg, redo = read(argv)
    except (ConfigFlagError, LaunchError) as e:
        return _error(e, 2)
    if cfg is None:  # --help
        return 0
    index = writer_index(flags)
    try:  # before JAX starts: a second job on this run directory is refused in a fraction of a second
        held = run_lock.acquire(cfg.output_dir) if index == 0 else None
    except LaunchError as e:
        return _error(e, 2)
    try:
        if restart:
            if held:
                held.keep_over_exec()
            kvjax_allocator.reexec()  # huge pages for the weights: a restart, once (kvjax.allocator says why)
            if held:
                held.stay()
        return run(cfg, redo, flags, allocator, lock_later=index is None)
    finally:
        if held:
            held.release()


def writer_index(flags: LaunchFlags) -> int | None:
    """This process's index in the job as known before JAX starts (0: the one that writes the run directory and holds
    its lock), from the flags or JAX's environment variables; None when only jax.distributed can tell (--distributed=on
    on a cluster JAX detects): the lock is taken once it has started."""
    if flags.distributed == "off":
        return 0
    coordinator = flags.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if flags.distributed == "auto" and not coordinator:
        return 0  # one process (kvjax.distributed.initialize starts nothing)
    index = flags.process_id if flags.process_id is not None else os.environ.get("JAX_PROCESS_ID")
    try:
        return None if index in (None, "") else int(index)
    except ValueError:
        return None  # reported by kvjax.distributed.initialize


def run(cfg: RunConfig, redo: tuple[str, ...], flags: LaunchFlags, allocator: str = "",
        lock_later: bool = False) -> int:
    """main() from a config that passed the command line's checks: the stages take over (JAX starts here).
    `lock_later`: whether this process writes the run directory is known only once jax.distributed has started; it
    locks the directory then (kvjax.job.execute.start)."""
    from kvjax.job import execute as stages
    try:
        job = stages.start(cfg, redo, flags, lock=lock_later)
    except stages.BAD_INPUT as e:
        return _error(e, 2)
    try:  # before any weights are read: the stages' programs by their shapes against the devices' memory
        check_fits(cfg)
    except LaunchError as e:
        if job.lock is not None:
            job.lock.release()
        return _error(e, 2)
    try:
        setup_logging(cfg.output_dir, job.process_index)
        log.info("kvjax.launch --config=%s -> %s (%s)", cfg.name, cfg.output_dir, job.placement())
        log.info("host allocator: %s", allocator)
        log.info("settings:\n%s", describe_config(cfg))
        try:
            summary = job.execute()
        except stages.BAD_INPUT as e:
            log.error("%s", e)
            return _error(e, 1)
    finally:
        if job.lock is not None:
            job.lock.release()
    print(f"report: {os.path.join(cfg.output_dir, 'report.md')}  metrics: "
          f"{os.path.join(cfg.output_dir, 'metrics.json')}  quality gate: "
          f"{'PASS' if summary['gate']['passed'] else 'FAIL'}  ({summary['seconds']:.1f}s, "
          f"{len(summary['ran'])} stages run, {len(summary['reused'])} reused)")
    return 0


def check_fits(cfg: RunConfig) -> None:
    """Before any weights are read: the stages' programs on these devices, by their shapes (kvjax.plan.check), against
    the devices' memory (--config.mesh.device_memory_gb, else what the device reports; CPU devices report none)."""
    from kvjax.plan.check import check_job
    from kvjax.plan.hardware import PlanError
    try:
        check_job(cfg, memory_bytes=cfg.mesh.device_memory_gb * 1e9 or None)
    except PlanError as e:
        raise LaunchError(str(e)) from None
