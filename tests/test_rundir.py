"""The run directory of `python -m kvjax.launch` under what machines do: one job per directory (kvjax.job.lock), a
full or read-only disk (kvjax.job.disk), a SIGKILL in any stage. Each job is the command as a subprocess on the
tiny random pair of test_launch, one CPU device, its final metrics.json compared with an uninterrupted run's of the
same command (`reference`) but for the fields that differ from run to run (`wall_clock`)."""

import errno
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_launch import REPO, SMALL, tiny_pair, write_mc_sets

from kvjax.job import command as launch
from kvjax.job import disk, lock
from kvjax.job.markers import read_json

HARD_TIMEOUT = 600  # seconds for any one job subprocess: a safety net (a whole tiny job takes ~20 s on 2 idle cores)
# a few seconds a stage: the pair of test_launch at its sizes, the default config's stages (the per-head peer, six
# evaluations); the teacher pool and the fact-copy windows need far more text than these runs read
TINY = [*SMALL, "--config.residual.pool_windows=0", "--config.residual.copy_windows=0",
        "--config.eval.retrieval.files="]
# metrics.json fields that differ between two uninterrupted runs of the same command (measured: two runs, 769 leaves,
# these differed and nothing else): wall-clock times and what is computed from them, and the run directory's path
# where the runs compared use two directories
THROUGHPUT_SETTINGS = ("new_tokens", "batch_size", "repeats", "decode_repeats", "paired_decode")


def wall_clock(path: tuple) -> bool:
    """Whether the metrics.json leaf at `path` legitimately differs from run to run."""
    if path[0] == "run":
        return (path[1] in ("stage_seconds", "finished_at", "output_dir") or path[1:3] == ("settings", "output_dir")
                or (path[1] == "maps" and path[-1] == "fit_seconds"))
    return path[0] == "throughput" and path[2] not in THROUGHPUT_SETTINGS  # times, rates and their ratios


def leaves(obj, path=()) -> dict:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in leaves(value, (*path, key)).items()}
    if isinstance(obj, list):
        return {k: v for i, value in enumerate(obj) for k, v in leaves(value, (*path, i)).items()}
    return {path: obj}


def compare_metrics(got_path, want_path, also_differ=lambda path: False) -> int:
    """Assert that two metrics.json agree exactly but for `wall_clock` fields (and `also_differ`'s); returns how
    many numbers were compared."""
    got, want = leaves(read_json(got_path)), leaves(read_json(want_path))
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    timed = [p for p in want if wall_clock(p)]
    assert any(p[:2] == ("run", "stage_seconds") for p in timed)  # the fields left out are there
    kept = [p for p in want if not wall_clock(p) and not also_differ(p)]
    differ = [(".".join(map(str, p)), got[p], want[p]) for p in kept if got[p] != want[p]]
    assert not differ, f"{len(differ)} of {len(kept)} fields differ: {differ[:8]}"
    return sum(isinstance(want[p], (int, float)) and not isinstance(want[p], bool) for p in kept)


def job_env() -> dict:
    """The jobs' environment: one CPU device (a fifth less CPU time than conftest's 8 for these stages; every job
    compared runs on it), this test session's compilation cache, the command's own allocator settings (where they
    apply, it restarts once under them, keeping the run directory's lock across: kvjax.allocator)."""
    env = {k: v for k, v in os.environ.items() if k not in (lock.ENV_FD, "KVJAX_MALLOC")}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def start_job(out, log_path):
    """`python -m kvjax.launch` on the tiny pair into `out`, in its own process group, output to `log_path`."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "kvjax.launch", *JOB, f"--config.output_dir={out}"],
                            cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc, timeout=HARD_TIMEOUT) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"job still running after {timeout} s: killed")


def read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


JOB: list[str] = []  # the reference's command line (its models and multiple-choice sets), set by `reference`


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny job run twice, uninterrupted: the first compiles every program into the session's compilation
    cache, the second reads them from it as every later job here does. The two metrics.json differ in the
    `wall_clock` fields only. Returns the second: (run directory, its stages in order, their seconds)."""
    root = tmp_path_factory.mktemp("rundir")
    source, target = tiny_pair(str(root))
    JOB[:] = [f"--config.source.path={source}", f"--config.target.path={target}", *TINY, *write_mc_sets(str(root))]
    for name in ("compiling", "reference"):
        proc = start_job(root / name, root / f"{name}.log")
        assert finish(proc) == 0, read(root / f"{name}.log")[-6000:]
    out = root / "reference"
    compare_metrics(root / "compiling" / "metrics.json", out / "metrics.json")
    order = re.findall(r"stage (\w+) +running", read(out / "run.log"))
    seconds = {name: read_json(out / "stages" / f"{name}.json")["seconds"] for name in order}
    return out, order, seconds


def in_stage(text: str) -> str:
    """Where a job's output ends: inside the stage it last started ("NAME"), or between two ("after NAME")."""
    events = re.findall(r"stage (\w+) +(running|done)", text)
    if not events:
        return "before the first stage"
    name, what = events[-1]
    return name if what == "running" else f"after {name}"


# ---- one job per run directory -------------------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from kvjax.job import lock
    held = lock.acquire(sys.argv[1], ["python", "-m", "kvjax.launch", "--config.output_dir=" + sys.argv[1]])
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_job_is_refused_at_once_naming_the_holder_and_a_killed_holder_frees_the_directory(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=REPO, env=job_env(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        refused = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvjax.launch",
                                  f"--config.output_dir={out}", "--config.residual.steps=0"], cwd=REPO,
                                 env=job_env(), capture_output=True, text=True, timeout=60)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"refused in {wall:.2f} s ({cpu:.2f} CPU s)")
        lines = refused.stderr.splitlines()
        imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines if line.startswith("import time:")}
        err = [line for line in lines if not line.startswith("import time:")]
        assert refused.returncode == 2 and len(err) == 1, err  # one line
        assert f"run directory {out} is in use by another job: pid {holder.pid} on " in err[0]
        assert f"running `python -m kvjax.launch --config.output_dir={out}`" in err[0]
        # before JAX starts (the real entry point, its allocator restart included), in a fraction of a second of
        # CPU; the wall clock is the machine's load's (a refusal that waited for the lock would last as long as the
        # holder does)
        assert not imported & {"jax", "jaxlib", "flax", "optax", "orbax"}, imported
        assert cpu < 1.0 and wall < 5.0
        assert sorted(os.listdir(out)) == [".lock"]  # nothing written
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    again = lock.acquire(str(out))  # the kernel released the killed holder's lock: usable at once
    assert lock.holder(str(out))["pid"] == os.getpid()
    again.release()


def test_the_lock_survives_the_commands_restart_and_leaves_no_directory_when_refused_before_any_work(tmp_path):
    out = str(tmp_path / "run")
    held = lock.acquire(out)
    held.keep_over_exec()  # as the command does before os.execve: the restarted process adopts the descriptor
    adopted = lock.acquire(out)
    assert adopted.fd == held.fd and lock.ENV_FD not in os.environ and not os.get_inheritable(held.fd)
    with pytest.raises(lock.RunDirInUse, match=f"pid {os.getpid()}"):  # a second descriptor: refused
        lock.acquire(out)
    adopted.release()
    assert not os.path.exists(out)  # made by acquire and holding only the lock: removed with it
    os.makedirs(out)
    lock.acquire(out).release()
    assert os.listdir(out) == [".lock"]  # a directory that was there stays


def test_the_server_reads_a_locked_run(reference):
    from kvjax.serve import cli
    out, _, _ = reference
    with lock.acquire(str(out)):
        _, _, _, map_dir, gate = cli.parse([*JOB, f"--config.output_dir={out}"])
    assert map_dir == os.path.join(str(out), "map") and gate == os.path.join(str(out), "gate.json")


# ---- the disk ------------------------------------------------------------------------------------------------------

def test_the_estimate_covers_what_each_stage_wrote(reference):
    from kvjax.job.stages import plan
    out, order, _ = reference
    cfg, _, _ = launch.parse([*JOB, f"--config.output_dir={out}"])
    sizes = disk.estimate(cfg)
    assert list(sizes) == ["run", *plan(cfg)] == ["run", *order]

    def du(path):
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    stages = plan(cfg)
    wrote = {name: sum(du(out / o) for o in stage.outputs if (out / o).exists()) for name, stage in stages.items()}
    wrote["report"] += sum(du(out / f) for f in os.listdir(out) if f.endswith(".png"))
    for name, n in wrote.items():
        assert 0 < n <= sizes[name], (name, n, sizes[name])
    print({name: f"{wrote[name] / 2**20:.2f} / {sizes[name] / 2**20:.2f} MB" for name in wrote})


def test_too_little_space_is_refused_before_the_first_stage(reference, tmp_path, monkeypatch, capsys):
    """A faked free-space reading (the real full disk: test_a_full_and_a_read_only_disk_mid_stage)."""
    out = tmp_path / "run"
    monkeypatch.setattr(disk, "free_bytes", lambda path: 3 * disk.MB)
    assert launch.main([*JOB, f"--config.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"error: the run needs ~\d+ MB in {out} \(residual \d+ MB, .*\), 3 MB free on \S+ \(/\S*\): "
                     "free some space or pass another --config.output_dir\n$", err), err
    assert not out.exists()  # refused before writing anything


def test_refused_writes_are_one_line_naming_device_path_and_stage(tmp_path):
    run = str(tmp_path)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(run, "eval", "kl.json.tmp"))
    assert disk.failed_write(full, run) == (errno.ENOSPC, full.filename)
    line = disk.describe(*disk.failed_write(full, run), "kl", run)
    assert re.fullmatch(rf"no space left on \S+ \(/\S*\) for {full.filename} \(kl\): \d+ MB free; free some space "
                        r"and run the same command again to resume \(finished stages are kept\)", line)
    ckpt = os.path.join(run, "residual", "residual_ckpt", "2.orbax-checkpoint-tmp", "d", "7c72")
    orbax = ValueError(f'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file "{run}/x/": Failed '
                       f'writing: "{ckpt}": Failed to write 279163 bytes to file 12: No space left on device '
                       "[os_error_code='28']")
    try:  # wrapped as orbax's background threads re-raise it
        raise RuntimeError("save failed") from orbax
    except RuntimeError as e:
        assert disk.failed_write(e, run) == (errno.ENOSPC, ckpt)
    ro = OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(run, "metrics.json.tmp"))
    assert disk.describe(*disk.failed_write(ro, run), "report", run).startswith(
        f"read-only filesystem {disk.device(run)} for {ro.filename} (report): make it writable")
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(run, "data.tmp", "calib.npy"))
    assert disk.describe(*disk.failed_write(denied, run), "calibrate", run).startswith(
        f"no permission to write {denied.filename} (calibrate) on ")
    unreadable = OSError(errno.EACCES, os.strerror(errno.EACCES), "/models/source/model.safetensors")
    assert disk.failed_write(unreadable, run) is None  # a checkpoint the job cannot read is no write
    assert disk.failed_write(ValueError("bad value"), run) is None


REFUSING = textwrap.dedent("""
    import os, sys
    from kvjax import launch
    from kvjax.job import evaluations, markers

    code, argv = int(sys.argv[1]), sys.argv[2:]

    def write_json(path, obj):  # the disk refuses eval/kl.json after half a file
        if str(path).endswith("eval/kl.json"):
            with open(str(path) + ".tmp", "w") as f:
                f.write("{")
            raise OSError(code, os.strerror(code), str(path) + ".tmp")
        return markers.write_json(path, obj)

    evaluations.write_json = write_json
    sys.exit(launch.main(argv))
""")


def undo(out, stages: list[str], outputs: list[str]) -> None:
    """A finished run directory as a run killed right before `stages` would leave it (their markers and outputs
    gone)."""
    for name in stages:
        os.remove(out / "stages" / f"{name}.json")
    for name in outputs:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_a_write_refused_mid_stage_is_one_line_and_the_rerun_resumes(reference, tmp_path):
    """The disk refusing a write simulated at the stages' JSON writer (no space, then no permission: whatever the
    user, as root ignores permissions), in a job whose kl stage and report are still to run (the reference's run
    directory with those undone): each time one line, nothing of the stage kept; then the same command finishes the
    run. The real full and read-only disks: test_a_full_and_a_read_only_disk_mid_stage."""
    ref, _, _ = reference
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    undo(out, ["kl", "report"], ["eval/kl.json", "metrics.json", "report.md", "gate.json"])
    argv = [*JOB, f"--config.output_dir={out}"]
    path, device = out / "eval" / "kl.json.tmp", disk.device(str(out))
    for code, want in ((errno.ENOSPC, f"no space left on {device} for {path} (kl): "),
                       (errno.EACCES, f"no permission to write {path} (kl) on {device}: make it writable")):
        refused = subprocess.run([sys.executable, "-c", REFUSING, str(code), *argv], cwd=REPO, env=job_env(),
                                 capture_output=True, text=True, timeout=HARD_TIMEOUT)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-4000:]
        assert refused.stderr.splitlines()[-1].startswith(f"kvjax.launch: error: {want}"), refused.stderr[-2000:]
        assert not path.exists() and not (out / "eval" / "kl.json").exists()
        assert not (out / "stages" / "kl.json").exists()
    log = tmp_path / "rerun.log"
    assert finish(start_job(out, log)) == 0, read(log)[-4000:]
    assert re.search(r"stage kl +running", read(log)) and re.search(r"stage distances +reused", read(log))
    print(f"{compare_metrics(out / 'metrics.json', ref / 'metrics.json')} numbers equal the reference's")


DISKS = textwrap.dedent("""
    # Run in a mount namespace of its own (unshare -rm): tmpfs filesystems of a given size, a read-only bind mount.
    import json, os, shutil, subprocess, sys, time
    ref, work, job = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    fs, result = os.path.join(work, "fs"), {}
    os.makedirs(fs)

    def mount(*args):
        subprocess.run(["mount", *args], check=True)

    def launch(out, name, wait=None):
        with open(os.path.join(work, name + ".log"), "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvjax.launch", *job, "--config.output_dir=" + out],
                                    stdout=log, stderr=subprocess.STDOUT)
        if wait is not None:
            wait(proc)
        result[name] = {"rc": proc.wait(), "files": sorted(os.path.relpath(os.path.join(d, f), out)
                                                            for d, dirs, files in os.walk(out) for f in files + dirs)}

    def fill(proc):  # someone else fills the disk once the residual stage has begun writing
        while not os.path.exists(os.path.join(run, "residual", "residual_identity.json")) and proc.poll() is None:
            time.sleep(0.005)
        with open(os.path.join(fs, "filler"), "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(b"x" * chunk)
                except OSError:
                    pass

    # a filesystem too small for the run: refused before the first stage
    mount("-t", "tmpfs", "-o", "size=3m", "tmpfs", fs)
    launch(os.path.join(fs, "small"), "small")
    subprocess.run(["umount", fs], check=True)
    # a read-only one: refused at the lock
    mount("-t", "tmpfs", "-o", "ro,size=3m", "tmpfs", fs)
    launch(os.path.join(fs, "ro"), "read_only_root")
    subprocess.run(["umount", fs], check=True)
    # room for the run, filled by someone else during the residual stage; the run directory is the reference's up to
    # its ridge
    mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", fs)
    run = os.path.join(fs, "run")
    shutil.copytree(ref, run)
    stages = [s[:-5] for s in os.listdir(os.path.join(run, "stages"))]
    for name in os.listdir(run):
        if name not in ("data", "map_ridge", "stages", "config.json", "run.log", ".lock"):
            shutil.rmtree(os.path.join(run, name)) if os.path.isdir(os.path.join(run, name)) else \
                os.remove(os.path.join(run, name))
    for name in stages:
        if name not in ("calibrate", "ridge"):
            os.remove(os.path.join(run, "stages", name + ".json"))
    launch(run, "full", wait=fill)
    os.remove(os.path.join(fs, "filler"))
    # space again, but eval/ read-only (a bind mount: Linux refuses to remount a filesystem with files open for
    # writing, the job's log)
    eval_dir = os.path.join(run, "eval")
    os.makedirs(eval_dir, exist_ok=True)
    mount("--bind", eval_dir, eval_dir)
    mount("-o", "remount,bind,ro", eval_dir)
    launch(run, "read_only_eval")
    subprocess.run(["umount", eval_dir], check=True)
    launch(run, "resumed")
    shutil.copy(os.path.join(run, "metrics.json"), os.path.join(work, "metrics.json"))
    print(json.dumps(result))
""")


def can_mount(where) -> bool:
    """Whether this user may make tmpfs filesystems in a mount namespace of its own (unshare -rm)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow  # the job's stages from the residual on, three times (~30 s on 2 idle cores)
def test_a_full_and_a_read_only_disk_mid_stage(reference, tmp_path):
    """Real filesystems (tmpfs in a mount namespace of the test's own): a 3 MB one refuses the run before its first
    stage; a read-only one at the lock; one filled by another writer while the residual stage writes ends the job
    with one line, nothing left under a final or temporary name; a read-only eval/ ends it in the first evaluation
    the same way; once both are writable, the same command resumes and ends with the uninterrupted metrics."""
    if not can_mount(tmp_path):
        pytest.skip("no tmpfs in a user mount namespace here (unshare -rm); the refused writes are simulated in "
                    "test_a_write_refused_mid_stage_is_one_line_and_the_rerun_resumes")
    ref, _, _ = reference
    driver = subprocess.run(["unshare", "-rm", sys.executable, "-c", DISKS, str(ref), str(tmp_path), json.dumps(JOB)],
                            cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert driver.returncode == 0, driver.stderr[-4000:]
    result = json.loads(driver.stdout.splitlines()[-1])
    fs = tmp_path / "fs"

    def last_line(name):
        text = read(tmp_path / f"{name}.log")
        assert "Traceback" not in text, text[-4000:]
        return text.splitlines()[-1]
    assert result["small"]["rc"] == 2 and result["small"]["files"] == []
    assert re.fullmatch(rf"kvjax.launch: error: the run needs ~\d+ MB in {fs}/small \(.*\), \d MB free on tmpfs "
                        rf"\({fs}\): free some space or pass another --config.output_dir", last_line("small"))
    assert result["read_only_root"]["rc"] == 2
    assert last_line("read_only_root").startswith(f"kvjax.launch: error: read-only filesystem tmpfs ({fs}) for "
                                                  f"{fs}/ro (locking the run directory)")
    full = result["full"]
    line = last_line("full")
    assert full["rc"] == 1 and re.match(rf"kvjax.launch: error: no space left on tmpfs \({fs}\) for {fs}/run/"
                                        r"\S+ \(residual\): 0 MB free; free some space and run the same command "
                                        "again", line), line
    assert "stages/residual.json" not in full["files"] and "map/manifest.json" not in full["files"]
    assert not [f for f in full["files"] if ".tmp" in f or "orbax-checkpoint-tmp" in f], full["files"]
    read_only = result["read_only_eval"]
    line = last_line("read_only_eval")
    assert read_only["rc"] == 1 and line.startswith(
        f"kvjax.launch: error: read-only filesystem tmpfs ({fs}/run/eval) for {fs}/run/eval/distances.json.tmp "
        "(distances): make it writable"), line
    assert "stages/residual.json" in read_only["files"] and "stages/distances.json" not in read_only["files"]
    assert result["resumed"]["rc"] == 0, read(tmp_path / "resumed.log")[-4000:]
    assert re.search(r"stage ridge +reused", read(tmp_path / "resumed.log"))
    print(f"{compare_metrics(tmp_path / 'metrics.json', ref / 'metrics.json')} numbers equal the reference's")


# ---- a kill in any stage -------------------------------------------------------------------------------------------

def kill_when(proc, log_path, stage: str, delay: float, then=None, meanwhile=None) -> str:
    """SIGKILL the job's process group `delay` seconds after it starts `stage` (or, `then` a path, once that path
    exists after it started it); `meanwhile()` runs once the stage started. Returns where the kill landed
    (`in_stage`)."""
    deadline = time.monotonic() + HARD_TIMEOUT
    while not re.search(rf"stage {stage} +running", read(log_path)):
        if proc.poll() is not None:
            pytest.fail(f"the job ended (status {proc.returncode}) before stage {stage}:\n{read(log_path)[-4000:]}")
        assert time.monotonic() < deadline, f"stage {stage} did not start"
        time.sleep(0.01)
    started = time.monotonic()
    if meanwhile is not None:
        meanwhile()
    if then is not None:
        while not os.path.exists(then) and proc.poll() is None:
            time.sleep(0.005)
    else:
        time.sleep(max(0.0, started + delay - time.monotonic()))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return in_stage(read(log_path))


@pytest.mark.slow  # a dozen restarts of the job (~1 min on 2 idle cores)
def test_a_kill_in_any_stage_resumes_to_the_uninterrupted_metrics(reference, tmp_path):
    """The job SIGKILLed (its whole process group) at a random moment of every stage in turn, and restarted with the
    same command each time: a stage the kill interrupted starts over (the residual from its last checkpoint) and the
    final metrics.json equals the uninterrupted run's but for wall-clock fields (`wall_clock`). A kill lands a
    uniform draw over 5-85% of the stage's seconds in the reference into the stage (both read their programs from
    the compilation cache); one that landed past it (the machine's load varies) is undone, the run directory put
    back as it was before that attempt, and tried again at half the delay. Two kills more are set by what the job
    has written: right after the residual's first checkpoint, and right after the report's metrics.json. While one
    restart runs its longest stage, a second job on the directory is refused."""
    ref, order, seconds = reference
    out, before = tmp_path / "run", tmp_path / "before"
    rng = random.Random(68)
    events = {"residual": out / "residual" / "residual_ckpt" / "2", "report": out / "metrics.json"}
    plan = [(name, None) for name in order] + [(name, path) for name, path in events.items()]
    plan.sort(key=lambda p: order.index(p[0]))  # in stage order: each restart runs the next one first
    longest = max(order, key=seconds.get)
    kills, undone, refused, logs = [], [], [], []

    def second_job():  # the directory is held: refused at once, naming this job
        t0 = time.perf_counter()
        second = subprocess.run([sys.executable, "-m", "kvjax.launch", *JOB, f"--config.output_dir={out}"],
                                cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
        refused.append(time.perf_counter() - t0)
        assert second.returncode == 2 and f"is in use by another job: pid {proc.pid} on" in second.stderr, \
            second.stderr[-3000:]
    for stage, then in plan:
        delay = rng.uniform(0.05, 0.85) * seconds[stage]
        for _ in range(4):
            if out.exists():
                shutil.rmtree(before, ignore_errors=True)
                shutil.copytree(out, before)
            logs.append(tmp_path / f"attempt{len(logs) + 1}.log")
            proc = start_job(out, logs[-1])
            hit = kill_when(proc, logs[-1], stage, delay, then,
                            second_job if stage == longest and not refused else None)
            if hit == stage:
                break
            undone.append((stage, delay, hit))  # past the stage: as if this attempt never ran
            shutil.rmtree(out)
            if before.exists():
                shutil.copytree(before, out)
            delay /= 2
        kills.append((stage, f"on {then.name}" if then else f"{delay:.2f} s", hit))
    logs.append(tmp_path / "final.log")
    assert finish(start_job(out, logs[-1])) == 0, read(logs[-1])[-6000:]
    print(f"{len(kills)} kills: " + "; ".join(f"{s} +{d} -> {h}" for s, d, h in kills)
          + f"; {len(undone)} undone past their stage: {undone}")
    assert [h for _, _, h in kills] == [s for s, _ in plan], kills
    assert "residual: resumed from step 2" in "".join(map(read, logs))  # the kill after the first checkpoint
    numbers = compare_metrics(out / "metrics.json", ref / "metrics.json")
    print(f"metrics.json: {numbers} numbers equal the uninterrupted run's; a second job refused in "
          f"{refused[0]:.2f} s")
