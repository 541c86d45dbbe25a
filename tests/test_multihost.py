"""`python -m kvjax.launch --config=toy` on two JAX processes (2 fake CPU devices each, gloo collectives) through
launch.cluster.multihost: its map equals the one-process run's; a dead peer ends the job quickly, with a clear
message; the rerun resumes to the same map as an uninterrupted run; a process killed mid-evaluation leaves a job that
one process finishes with the two-process run's metrics; a crash in the middle of a checkpoint save leaves the
previous checkpoint usable.

Every subprocess runs under a hard timeout, on a free port, and is killed by the test if it outlives it."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvjax
from kvjax.fitting.residual import ResidualConfig
from maptools import assert_maps_equal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARD_TIMEOUT = 900  # seconds for any one subprocess run: a safety net (a healthy run takes ~30 s on 2 idle cores,
# but 10-20x longer at nice 19 on a machine with a load average of 10)
STEPS, SAVE_EVERY = 30, 3
# the toy config (checkpoints/toy), cut to seconds of work: 8 x 64 calibration tokens, 30 residual steps of 4 short
# windows, evaluations off (process 0 runs them alone: nothing multi-process to test there)
TOY = ["--config=toy", "--config.data.max_train_tokens=6000", "--config.map.calib_windows=8",
       "--config.map.select_windows=4", "--config.map.window_len=64", "--config.map.batch_size=4",
       "--config.map.residual_rank=4", f"--config.residual.steps={STEPS}", "--config.residual.batch_size=4",
       "--config.residual.prefix_len=24", "--config.residual.cont_len=8", "--config.residual.warmup_steps=1",
       f"--config.residual.save_every={SAVE_EVERY}",
       *[f"--config.eval.{e}.enabled=false"
         for e in ("distances", "kl", "agreement", "mc", "retrieval", "throughput")]]
TWO_BY_TWO = ["--config.mesh.data=2", "--config.mesh.model=2", "--heartbeat_timeout=30", "--init_timeout=120"]
# 30 s, the job's default: at 10 s a loaded CI machine (two test workers and three jobs compiling on 2 cores) once
# starved the coordination service long enough to end a healthy run. A dead peer is then noticed in ~30-40 s,
# still well before the launcher's own 90 s grace would end the survivor
# One process vs two: the same sums in another order (per data-shard float32 chunks merged in float64, all-reduced
# gradients). Lambda (chosen from a grid) and the pairing must be identical. The weights themselves are not the
# thing to compare: at lambda 1e-3 on 512 calibration tokens the ridge solve amplifies float32 rounding to ~4e-4 of
# the largest weight (measured) along directions the calibration data barely excite, which the map's output does
# not see. What the map produces, the target's cache from held-out source caches, agreed to 4.6e-5 of its largest
# entry after the ridge and after 30 residual steps (measured); the tolerance leaves 4x margin.
CACHE_RTOL = 2e-4


def toy_job(out, extra=()):
    return [*TOY, f"--config.output_dir={out}", *extra]


def start(args, log_path, procs=2, devices=1):
    """The main job: `procs` processes x 2 fake devices through the local launcher, or one plain process (`devices`
    devices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop("XLA_FLAGS", None)
    if procs == 1:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        cmd = [sys.executable, "-m", "kvjax.launch", *args]
    else:
        cmd = [sys.executable, "-m", "launch.cluster.multihost", "--procs", str(procs), "--devices-per-proc", "2",
               "--grace", "90", "--timeout", str(HARD_TIMEOUT - 20), "--", "kvjax.launch", *args, *TWO_BY_TWO]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc, timeout=HARD_TIMEOUT):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"launcher still running after {timeout} s: killed")


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def child_pids(log_path):
    return {int(r): int(p) for r, p in re.findall(r"started process (\d+) \(pid (\d+)\)", read(log_path))}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# one evaluation, so that process 0 evaluates alone on its part of the mesh (the models' buffers seen from it) while
# process 1 waits
DISTANCES = ["--config.eval.distances.enabled=true", "--config.eval.distances.windows=2",
             "--config.eval.distances.window_len=64", "--config.eval.distances.batch_size=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The toy job on one process (1 device) and on 2 processes x 2 devices, side by side."""
    root = tmp_path_factory.mktemp("multihost")
    procs = {n: start(toy_job(root / f"run{n}", DISTANCES), root / f"run{n}.log", procs=n) for n in (1, 2)}
    for n, proc in procs.items():
        assert finish(proc) == 0, read(root / f"run{n}.log")[-6000:]
    return root


def mapped_caches(run_dir, name):
    """The target cache the map of `run_dir` gives for 4 held-out windows (one device of this process)."""
    import jax.numpy as jnp

    from maptools import native_cache
    scfg, sparams = kvjax.load_hf(os.path.join(ROOT, "checkpoints", "toy", "source"))
    held = np.load(os.path.join(run_dir, "data", "heldout.npy"))[:4, :128]
    cache = kvjax.apply_map(kvjax.load_map(os.path.join(run_dir, name)), native_cache(sparams, scfg, jnp.asarray(held)))
    return np.asarray(cache.k), np.asarray(cache.v)


def test_two_processes_give_the_one_process_map(runs):
    one, two = runs / "run1", runs / "run2"
    log = read(runs / "run2.log")
    assert "[launcher] all 2 processes finished" in log
    assert "calibrate: process 0 of 2 reads rows 0:2 of each 4-window batch" in log  # each its own half
    assert "calibrate: process 1 of 2 reads rows 2:4 of each 4-window batch" in log
    for name in ("map_ridge", "map"):
        m1, m2 = (json.loads(read(d / name / "manifest.json")) for d in (one, two))
        assert m1["info"]["lambdas"] == m2["info"]["lambdas"] and m1["info"]["pairing"] == m2["info"]["pairing"]
        for want, got in zip(mapped_caches(one, name), mapped_caches(two, name)):
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err <= CACHE_RTOL, f"{name}: mapped cache differs by {err:.1e} of its largest entry"
    # the run directory is process 0's: one set of markers and reports, process 1 logs beside run.log
    assert "process 0 of 2" in read(two / "run.log") and "process 1 of 2" in read(two / "run.p1.log")
    assert "process 1 of 2" not in read(two / "run.log")
    assert sorted(os.listdir(two / "stages")) == ["calibrate.json", "distances.json", "report.json", "residual.json",
                                                  "ridge.json"]
    assert len(read(two / "residual" / "residual_log.jsonl").splitlines()) == STEPS  # written once
    assert re.search(r"\[p1\].*stage distances +runs on process 0; waiting", log)
    metrics = {n: json.loads(read(d / "metrics.json")) for n, d in (("one", one), ("two", two))}
    assert metrics["two"]["run"]["devices"].startswith("4 x cpu")
    for kind in ("key_cos", "value_cos"):  # evaluated by process 0 on its 2 devices: the one-device numbers, up to
        for arm, value in metrics["one"]["distances"][kind].items():  # the maps' difference (1.3e-6 measured)
            assert metrics["two"]["distances"][kind][arm] == pytest.approx(value, abs=1e-5), (kind, arm)


def test_dead_peer_ends_the_job_and_the_rerun_resumes_to_the_same_map(runs):
    out, log_path = runs / "run_killed", runs / "run_killed.log"
    proc = start(toy_job(out), log_path)
    try:
        ckpt, deadline = out / "residual" / "residual_ckpt", time.monotonic() + HARD_TIMEOUT
        while not (ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())):  # a finished checkpoint
            assert proc.poll() is None, f"launcher ended before the first checkpoint:\n{read(log_path)[-6000:]}"
            assert time.monotonic() < deadline, "no checkpoint within the time limit"
            time.sleep(0.02)
        pids = child_pids(log_path)
        os.kill(pids[1], signal.SIGKILL)  # a peer dies mid-training
        killed_at = time.monotonic()
        while alive(pids[0]) and time.monotonic() - killed_at < 150:
            time.sleep(0.1)
        survivor_s = time.monotonic() - killed_at
        code = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = read(log_path)
    print(f"process 0 ended {survivor_s:.1f} s after its peer was killed")
    assert survivor_s < 80, f"process 0 still alive {survivor_s:.0f} s after its peer died:\n{log[-4000:]}"
    assert code != 0 and "process 1 was killed by SIGKILL" in log
    assert "all 2 processes finished" not in log, "the job finished before the kill: make it longer"
    assert re.search(r"\[p0\].*(detected fatal errors|another task died|unhealthy)", log), log[-4000:]
    steps_done = sorted(int(p.name) for p in (out / "residual" / "residual_ckpt").iterdir() if p.name.isdigit())
    assert steps_done and steps_done[-1] < STEPS
    assert not (out / "stages" / "residual.json").exists()

    elsewhere = runs / "run_killed_moved"  # the same interrupted run, resumed on another topology below
    shutil.copytree(out, elsewhere)

    rerun_log = runs / "run_killed2.log"
    assert finish(start(toy_job(out), rerun_log)) == 0, read(rerun_log)[-6000:]
    rerun = read(rerun_log)
    assert re.search(r"\[p0\].*stage calibrate +reused", rerun) and re.search(r"\[p1\].*stage ridge +reused", rerun)
    assert f"resumed from step {steps_done[-1]}" in rerun
    # bit-identical to the uninterrupted two-process run
    assert_maps_equal(kvjax.load_map(str(out / "map")), kvjax.load_map(str(runs / "run2" / "map")))

    # resumed on one process with one device: the checkpoint of the 2 x 2 mesh restores onto it, and the map is the
    # one-process run's (within the two topologies' difference, see CACHE_RTOL)
    moved_log = runs / "run_killed_moved.log"
    assert finish(start(toy_job(elsewhere), moved_log, procs=1)) == 0, read(moved_log)[-6000:]
    assert f"resumed from step {steps_done[-1]}" in read(moved_log)
    for want, got in zip(mapped_caches(runs / "run1", "map"), mapped_caches(elsewhere, "map")):
        assert np.abs(got - want).max() / np.abs(want).max() <= CACHE_RTOL


def test_a_process_killed_mid_evaluation_and_the_job_finished_on_one_gives_the_same_metrics(runs):
    """The two-process job with its evaluation still to run (run2's directory as the job leaves it once the residual
    is done): process 0, which evaluates alone on its 2 devices while process 1 waits, is SIGKILLed in the middle of
    the evaluation; at once (the kernel released its lock) the job is restarted as one process on 2 devices, the
    part of the mesh process 0 evaluated on (mesh 1 x 2). Its metrics.json equals the uninterrupted two-process
    run's but for wall-clock fields and where it ran (run.devices, the mesh's data axis)."""
    from test_rundir import compare_metrics
    out, log_path = runs / "run_eval_killed", runs / "run_eval_killed.log"
    shutil.copytree(runs / "run2", out)
    for name in ("stages/distances.json", "stages/report.json", "eval", "metrics.json", "report.md", "gate.json",
                 "distances.png"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    seconds = json.loads(read(runs / "run2" / "stages" / "distances.json"))["seconds"]
    proc = start(toy_job(out, DISTANCES), log_path)
    try:
        deadline = time.monotonic() + HARD_TIMEOUT
        while not re.search(r"\[p0\].*stage distances +running", read(log_path)):
            assert proc.poll() is None, f"launcher ended before the evaluation:\n{read(log_path)[-6000:]}"
            assert time.monotonic() < deadline, "no evaluation within the time limit"
            time.sleep(0.01)
        time.sleep(0.1 * seconds)  # a tenth of its (first, compiling) run: inside the evaluation
        os.kill(child_pids(log_path)[0], signal.SIGKILL)
        assert not re.search(r"\[p0\].*stage distances +done", read(log_path))
        assert re.search(r"\[p1\].*stage distances +runs on process 0; waiting", read(log_path))
        one_log = runs / "run_eval_killed_one.log"
        one = start(toy_job(out, DISTANCES + ["--config.mesh.data=1", "--config.mesh.model=2"]), one_log, procs=1,
                    devices=2)
        assert finish(one) == 0, read(one_log)[-6000:]
    finally:
        if proc.poll() is None:  # process 1 outlives its coordinator until JAX's heartbeats end it: not waited for
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rerun = read(one_log)
    assert re.search(r"stage residual +reused", rerun) and re.search(r"stage distances +running", rerun)
    placement = {("run", "devices"), ("run", "settings", "mesh", "data")}
    numbers = compare_metrics(out / "metrics.json", runs / "run2" / "metrics.json", lambda p: p in placement)
    print(f"{numbers} numbers equal the uninterrupted two-process run's")


CRASH_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from orbax.checkpoint._src.path import atomicity
    sys.path.insert(0, {tests!r})
    from test_multihost import crash_run

    workdir, crash_at = sys.argv[1], int(sys.argv[2])
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):  # die after the files are written, before the commit
        if os.path.basename(str(self._final_path)) == str(crash_at):
            print("crashing during the save of step", crash_at, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    out, hist = crash_run(workdir)
    print("steps", [h["step"] for h in hist], flush=True)
    np.savez(os.path.join(workdir, "final.npz"), *crash_run.leaves(out))
""")


def crash_run(workdir):
    """Residual training of a small identity + residual map, checkpointed every 2 of 6 steps."""
    import jax
    from kvjax.mapper.kvmap import KVMap, linear_map, spec_for
    from kvjax.mapper.ridge import RidgeFit
    from maptools import tiny_model
    cfg, params = tiny_model(2, 32, 2, 1, 16, seed=1, theta=5e3)
    eye = np.eye(16, dtype=np.float32)
    fit = RidgeFit(mu=np.zeros(16), w_in=eye, w_out=eye, bias=np.zeros(16), lam=0.0)
    layers = tuple(linear_map(fit, 4, jax.random.key(i), 1.0) for i in range(2))
    kvmap = KVMap(keys=layers, values=layers, spec=spec_for(cfg, cfg, ((0,), (1,)), None, 4))
    tokens = np.random.RandomState(3).randint(1, 96, 3000).astype(np.uint16)
    rc = ResidualConfig(steps=6, batch_size=2, prefix_len=16, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2)
    return kvjax.train_residual(kvmap, (cfg, params), (cfg, params), tokens, rc, workdir=workdir)


crash_run.leaves = lambda kvmap: [np.asarray(a) for a in __import__("jax").tree.leaves(kvmap)]


def test_crash_during_a_checkpoint_save_leaves_the_previous_one_usable(tmp_path):
    import orbax.checkpoint as ocp
    code = CRASH_CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the same 8 fake devices as this process (conftest)
    run = lambda crash_at: subprocess.run([sys.executable, "-c", code, str(tmp_path), str(crash_at)],  # noqa: E731
                                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HARD_TIMEOUT)
    first = run(4)
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr[-4000:]
    assert "crashing during the save of step 4" in first.stdout
    assert any(".orbax-checkpoint-tmp" in p.name for p in (tmp_path / "residual_ckpt").iterdir())  # half-written
    assert ocp.CheckpointManager(str(tmp_path / "residual_ckpt")).latest_step() == 2  # ... and not taken for one
    second = run(-1)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "steps [3, 4, 5, 6]" in second.stdout  # resumed from step 2
    resumed = np.load(tmp_path / "final.npz")
    straight, _ = crash_run(None)  # uninterrupted, no checkpoints, in this process
    for i, want in enumerate(crash_run.leaves(straight)):
        np.testing.assert_array_equal(resumed[f"arr_{i}"], want)
