"""The Job: one run's stages in order, each skipped when its marker matches (kvjax.job.markers), and `start`,
what `python -m kvjax.launch` hands a checked config to. Imports JAX: the command line imports this module only once
its own checks (kvjax.run.preflight.check_fast) have passed."""

from __future__ import annotations

import logging
import os
import time

import jax
from tqdm import tqdm

from kvjax import aot, distributed
from kvjax.config_flags import ConfigFlagError, LaunchFlags, to_dict
from kvjax.corpus import CorpusError
from kvjax.hf import CheckpointError
from kvjax.models.config import ConfigError
from kvjax.run.preflight import LaunchError, check_processes, validate
from kvjax.run.config import RunConfig
from kvjax.job import calibration, disk, evaluations, maps, reporting
from kvjax.job import lock as run_lock
from kvjax.job.context import Context
from kvjax.job.markers import StageConflict, read_json, write_json
from kvjax.run.layout import COLLECTIVE
from kvjax.job.stages import plan
from kvjax.tensorfile import SafetensorsError

log = logging.getLogger("kvjax.launch")

# bad input whose message already says what to fix: the command prints it alone, no traceback. Checkpoint weights
# are first read inside a stage, before it writes anything, and a stage is marked done only once finished, so a
# rerun after the fix redoes exactly that stage. The same for a write the disk refuses (disk.WriteFailed, a
# LaunchError): a rerun once the disk takes writes again redoes the stage it interrupted.
BAD_INPUT = (ConfigFlagError, LaunchError, CorpusError, CheckpointError, ConfigError, SafetensorsError)


class Job(Context):
    """The stages of one run. In a multi-process run every process builds a Job: all of them run the data-parallel
    stages (COLLECTIVE) on the mesh over every device; process 0 alone runs the others on its own devices (`local`)
    and writes the run directory's shared files, while the others wait. A Job asks JAX which process it is: start
    jax.distributed (kvjax.distributed.initialize, as `start` does) before building one."""

    COLLECTIVE = COLLECTIVE

    # each stage is a function (job, stage) of its module; an evaluation's is evaluations.run. As methods, a stage can
    # also be run by hand: job.stage_calibrate(job.stages["calibrate"])
    stage_calibrate = calibration.run
    stage_ridge = maps.ridge
    stage_residual = maps.residual
    stage_perhead = maps.perhead
    stage_bridge = maps.bridge
    stage_eval = evaluations.run
    stage_report = reporting.run

    def __init__(self, cfg: RunConfig, redo: tuple[str, ...] = (), step_timeout: float = 0.0):
        super().__init__(cfg)
        self.stages = plan(cfg)
        self.redo = redo
        self.step_timeout = step_timeout  # kvjax.distributed.Watchdog over the collective stages (0: off)
        self.seconds: dict[str, float] = {}
        self.reused: list[str] = []
        self.lock: run_lock.RunLock | None = None  # the run directory's, when `start` took it
        self.need = 0  # bytes the stages still to run will write (estimated by `check`)
        self._checked = False

    def placement(self) -> str:
        """This process and the devices, for the log."""
        return (f"process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices: "
                f"{jax.devices()[0].device_kind}")

    def check(self) -> None:
        """Apply --redo, then make sure no finished stage conflicts with these settings and that what the stages
        still to run will write fits the disk (kvjax.job.disk.check_space; before any work)."""
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
        todo = []
        for name, stage in self.stages.items():
            try:
                if not self.run.done(stage):
                    todo.append(name)
            except StageConflict as e:
                raise LaunchError(str(e)) from None
        if self.run.writer and todo:
            self.need = disk.check_space(self.cfg, todo, self.run.root)

    def execute(self) -> dict:
        self.check()
        if self.run.writer:
            with self.run.writing(None, "config.json"):
                os.makedirs(self.run.root, exist_ok=True)
                write_json(self.run.path("config.json"), to_dict(self.cfg))
        if self.need:
            log.info("disk: the stages to run write ~%d MB, %d MB free on %s", disk.mb(self.need),
                     disk.mb(disk.free_bytes(self.run.root), down=True), disk.device(self.run.root))
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
                self.scope(collective)
                log.info("stage %-10s running%s", name, "" if jax.process_count() == 1 else
                         f" on {'all' if collective else 'the'} {self.mesh().size} devices of "
                         f"{'every process' if collective else 'process 0'}")
                t0, c0 = time.perf_counter(), time.process_time()
                with self.run.writing(stage):  # a write the disk refuses: one line, nothing half-written kept
                    with jax.set_mesh(self.mesh()), distributed.Watchdog(self.step_timeout if collective else 0), \
                            aot.section(name):
                        getattr(self, f"stage_{name}", self.stage_eval)(stage)
                    self.seconds[name] = time.perf_counter() - t0
                    cpu = time.process_time() - c0
                    self.run.finish(stage, self.seconds[name], cpu)  # last: the stage is whole
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


def start(cfg: RunConfig, redo: tuple[str, ...], flags: LaunchFlags, lock: bool = False) -> Job:
    """A Job for a config that passed the command line's checks, ready to execute: the checks that read the models'
    configs and the registries (kvjax.run.preflight.validate), jax.distributed started when asked (flags or
    JAX_COORDINATOR_ADDRESS), and no finished stage in conflict (process 0 applies --redo first) nor too little
    space for the rest. `lock`: process 0 locks the run directory once jax.distributed says it is process 0 (the
    command locks it before JAX starts whenever it knows earlier; kvjax.job.lock), released with job.lock.
    Raises one of BAD_INPUT, having written nothing."""
    validate(cfg)
    try:  # before anything touches a device; a no-op unless asked for
        distributed.initialize_from_flags(flags)
    except ValueError as e:
        raise LaunchError(f"distributed: {e}") from None
    check_processes(cfg, jax.process_count())
    held = run_lock.acquire(cfg.output_dir) if lock and jax.process_index() == 0 else None
    try:
        job = Job(cfg, redo, step_timeout=flags.step_timeout)
        # conflicts with an earlier run are reported before anything is written; process 0 applies --redo first
        distributed.primary_first("check", job.check, LaunchError)
    except BaseException:
        if held is not None:
            held.release()
        raise
    job.lock = held
    return job
