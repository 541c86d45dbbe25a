"""Two JAX processes on localhost (2 fake CPU devices each, gloo collectives) through launch.multihost: the
distributed job equals one process; a dead peer ends the others quickly; kill -9 + relaunch resumes to the same
map; a crash in the middle of a checkpoint save leaves the previous checkpoint usable.

Every subprocess runs under a hard timeout, on a free port, and is killed by the test if it outlives it."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvjax
from kvjax.distributed import TokenWindows
from kvjax.mapper.residual import ResidualConfig
from maptools import assert_maps_equal, assert_maps_match, tiny_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARD_TIMEOUT = 900  # seconds for any one subprocess run: a safety net (a healthy run takes ~30 s on 2 idle cores,
# but 10-20x longer at nice 19 on a machine with a load average of 10)
STEPS, SAVE_EVERY = 20, 4


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    source, target = tiny_pair()
    kvjax.save_hf(str(root / "source"), *source)
    kvjax.save_hf(str(root / "target"), *target)
    np.save(root / "tokens.npy", np.random.RandomState(3).randint(1, 96, 6000).astype(np.uint16))
    return root


def job_args(root, out):
    return ["launch.fit_distributed", "--source", str(root / "source"), "--target", str(root / "target"),
            "--tokens", str(root / "tokens.npy"), "--out", str(out), "--calib-windows", "16", "--heldout-windows",
            "8", "--window", "40", "--batch-size", "8", "--residual-rank", "4", "--residual-steps", str(STEPS),
            "--residual-batch", "8", "--prefix", "24", "--cont", "8", "--lr", "1e-2", "--warmup", "2",
            "--save-every", str(SAVE_EVERY), "--mesh-data", "2", "--mesh-model", "2", "--heartbeat-timeout", "15",
            "--init-timeout", "120"]


def start_launcher(root, out, log_path):
    cmd = [sys.executable, "-m", "launch.multihost", "--procs", "2", "--devices-per-proc", "2", "--grace", "90",
           "--timeout", str(HARD_TIMEOUT - 20), "--", *job_args(root, out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop("XLA_FLAGS", None)
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


def single_process_reference(root):
    """The same fit + residual through the plain single-device API (no mesh, no jax.distributed)."""
    source, target = kvjax.load_hf(str(root / "source")), kvjax.load_hf(str(root / "target"))
    tokens = np.load(root / "tokens.npy")
    calib = np.asarray(TokenWindows.sample(tokens, 16, 40, seed=1))
    held = np.asarray(TokenWindows.sample(tokens, 8, 40, seed=2))
    kvmap, _ = kvjax.fit_map(source, target, calib, held, batch_size=8, residual_rank=4)
    rc = ResidualConfig(steps=STEPS, batch_size=8, prefix_len=24, cont_len=8, lr=1e-2, warmup_steps=2)
    return kvjax.train_residual(kvmap, source, target, tokens, rc)[0]


@pytest.fixture(scope="module")
def two_process_run(job_inputs):
    out, log_path = job_inputs / "run_a", job_inputs / "run_a.log"
    code = finish(start_launcher(job_inputs, out, log_path))
    assert code == 0, read(log_path)[-6000:]
    return out, log_path


def test_two_processes_fit_and_train_like_one_process(job_inputs, two_process_run):
    out, log_path = two_process_run
    log = read(log_path)
    assert "[launcher] all 2 processes finished" in log
    assert "calibrate: process 0 of 2 reads rows 0:4 of each 8-window batch" in log  # each its own half
    assert "calibrate: process 1 of 2 reads rows 4:8 of each 8-window batch" in log
    got = kvjax.load_map(str(out / "map"))
    assert_maps_match(got, single_process_reference(job_inputs))
    import json
    report = json.loads(read(out / "report.json"))
    assert report["processes"] == 2 and report["devices"] == 4 and report["mesh"] == {"data": 2, "model": 2}
    assert report["calib_tokens"] == 16 * 40  # every window counted once across the two processes
    lines = read(out / "residual_log.jsonl").splitlines()
    assert len(lines) == STEPS  # written by process 0 only
    manifest = json.loads(read(out / "map" / "manifest.json"))
    assert manifest["info"]["fit"]["processes"] == 2 and len(manifest["info"]["calib"]["starts_sha256"]) == 64


def test_dead_peer_ends_the_job_and_a_relaunch_resumes_to_the_same_map(job_inputs, two_process_run):
    out, log_path = job_inputs / "run_b", job_inputs / "run_b.log"
    proc = start_launcher(job_inputs, out, log_path)
    try:
        ckpt, deadline = out / "residual_ckpt", time.monotonic() + HARD_TIMEOUT
        while not (ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())):  # a finished checkpoint
            assert proc.poll() is None, f"launcher ended before the first checkpoint:\n{read(log_path)[-6000:]}"
            assert time.monotonic() < deadline, "no checkpoint within the time limit"
            time.sleep(0.02)
        pids = child_pids(log_path)
        os.kill(pids[1], signal.SIGKILL)  # a peer dies mid-training
        killed_at = time.monotonic()
        while alive(pids[0]) and time.monotonic() - killed_at < 90:
            time.sleep(0.1)
        survivor_s = time.monotonic() - killed_at
        code = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = read(log_path)
    assert survivor_s < 60, f"process 0 still alive {survivor_s:.0f} s after its peer died:\n{log[-4000:]}"
    assert code != 0 and "process 1 was killed by SIGKILL" in log
    assert "all 2 processes finished" not in log, "the job finished before the kill: make it longer"
    assert re.search(r"\[p0\].*(detected fatal errors|another task died|unhealthy)", log), log[-4000:]
    steps_done = sorted(int(p.name) for p in (out / "residual_ckpt").iterdir() if p.name.isdigit())
    assert steps_done and steps_done[-1] < STEPS

    relaunch_log = job_inputs / "run_b2.log"
    assert finish(start_launcher(job_inputs, out, relaunch_log)) == 0, read(relaunch_log)[-6000:]
    assert re.search(r"resumed from step (\d+)", read(relaunch_log))
    # bit-identical to the uninterrupted two-process run
    assert_maps_equal(kvjax.load_map(str(out / "map")), kvjax.load_map(str(two_process_run[0] / "map")))


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
