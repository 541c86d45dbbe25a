"""Run a kvjax job as N JAX processes on this machine (tests, laptops): the local stand-in for a multi-host launch.

    python -m launch.cluster.multihost --procs 2 --devices-per-proc 2 -- kvjax.launch --config=toy \
        --config.mesh.data=2 --config.mesh.model=2

Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES and JAX_PROCESS_ID (read by
kvjax.distributed.initialize) and, on CPU, --devices-per-proc fake devices; cross-process collectives are gloo.
Output lines are prefixed with [pI]. When a process fails, the others get --grace seconds to stop by themselves
(JAX's heartbeats end them once a peer is gone), then they are terminated; the launcher exits with the first
failure's status (128 + signal for a signal) and says who failed how. For TPU pods and SLURM clusters see
launch/cluster/templates/.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def child_env(rank: int, procs: int, port: int, devices: int, platform: str) -> dict:
    env = dict(os.environ)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(procs), JAX_PROCESS_ID=str(rank),
               PYTHONUNBUFFERED="1")
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    else:  # one process per group of local accelerators
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(rank * devices + i) for i in range(devices))
    return env


def _pump(rank: int, stream, lock: threading.Lock, log_file) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[p{rank}] {line}")
            sys.stdout.flush()
            if log_file is not None:
                log_file.write(line)
                log_file.flush()
    stream.close()


def launch(module: str, args: list[str], procs: int, devices: int, *, port: int | None = None, grace: float = 90.0,
           timeout: float = 0.0, platform: str = "cpu", log_dir: str | None = None) -> int:
    """Start `procs` processes of `python -m module args`, wait for them; returns the launcher's exit status."""
    port = port or free_port()
    lock = threading.Lock()
    children, pumps, logs = [], [], []
    say = lambda msg: (sys.stdout.write(f"[launcher] {msg}\n"), sys.stdout.flush())  # noqa: E731
    for rank in range(procs):
        log_file = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            log_file = open(os.path.join(log_dir, f"p{rank}.log"), "w")
        logs.append(log_file)
        child = subprocess.Popen([sys.executable, "-m", module, *args], env=child_env(rank, procs, port, devices,
                                 platform), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        children.append(child)
        say(f"started process {rank} (pid {child.pid}) of {procs}: python -m {module} (coordinator 127.0.0.1:{port})")
        pump = threading.Thread(target=_pump, args=(rank, child.stdout, lock, log_file), daemon=True)
        pump.start()
        pumps.append(pump)

    def stop_all(sig) -> None:
        for c in children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, sig)
                except ProcessLookupError:
                    pass

    def on_signal(signum, _frame):
        say(f"got {signal.Signals(signum).name}: stopping all processes")
        stop_all(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    start, first_failure, deadline, done = time.monotonic(), None, None, set()
    try:
        while len(done) < procs:
            for rank, c in enumerate(children):
                if rank in done or c.poll() is None:
                    continue
                done.add(rank)
                elapsed = time.monotonic() - start
                say(f"process {rank} {describe(c.returncode)} after {elapsed:.1f} s")
                if c.returncode != 0 and first_failure is None:
                    first_failure = (rank, c.returncode)
                    if len(done) < procs:
                        deadline = time.monotonic() + grace
                        say(f"waiting up to {grace:.0f} s for the other processes to stop by themselves")
            now = time.monotonic()
            if deadline is not None and now > deadline and len(done) < procs:
                say(f"processes {sorted(set(range(procs)) - done)} still running {grace:.0f} s after process "
                    f"{first_failure[0]} failed: terminating them")
                stop_all(signal.SIGTERM)
                time.sleep(5)
                stop_all(signal.SIGKILL)
                deadline = None
            if timeout and now - start > timeout and len(done) < procs:
                say(f"--timeout {timeout:.0f} s reached: killing all processes")
                stop_all(signal.SIGKILL)
                for c in children:
                    c.wait()
                return 124
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for pump in pumps:
            pump.join(timeout=5)
        for f in logs:
            if f is not None:
                f.close()
    if first_failure is None:
        say(f"all {procs} processes finished")
        return 0
    rank, code = first_failure
    say(f"FAILED: process {rank} {describe(code)} first; exit statuses "
        f"{[exit_status(c.returncode) for c in children]}")
    return exit_status(code)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: python -m launch.cluster.multihost [--procs N] [--devices-per-proc D] -- MODULE [ARGS...]")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python -m launch.cluster.multihost [options] -- MODULE [ARGS...]")
    p.add_argument("--procs", type=int, default=2, help="processes to start")
    p.add_argument("--devices-per-proc", type=int, default=1,
                   help="fake CPU devices per process (with --platform gpu: accelerators per process)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=90.0,
                   help="seconds the others get to stop by themselves after one fails")
    p.add_argument("--timeout", type=float, default=0.0, help="kill everything after this many seconds (0: never)")
    p.add_argument("--log-dir", default=None, help="also write each process's output to LOG_DIR/pI.log")
    opts = p.parse_args(argv[:split])
    rest = argv[split + 1 :]
    if not rest:
        p.error("name the module to run after --, e.g. -- kvjax.launch --config=toy")
    if opts.procs < 1 or opts.devices_per_proc < 1:
        p.error("--procs and --devices-per-proc must be >= 1")
    sys.exit(launch(rest[0], rest[1:], opts.procs, opts.devices_per_proc, port=opts.port, grace=opts.grace,
                    timeout=opts.timeout, platform=opts.platform, log_dir=opts.log_dir))


if __name__ == "__main__":
    main()
