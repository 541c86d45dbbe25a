"""Multi-process runs on JAX's distributed runtime (multi-controller: one Python process per host).

- `initialize` starts ``jax.distributed`` from flags (kvjax.config_flags.split_launch_flags: the main job's
  --distributed=...) or the usual environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``;
  with ``mode="on"`` and none of them, JAX's cluster detection for SLURM, Cloud TPU, MPI, ...). It must run before
  anything touches a JAX device.
- One job, many processes (kvjax.launch): `primary_first` runs a step on process 0 before the others,
  `wait_all` waits in the coordination service (for hours if need be, while process 0 works alone), `replicate`
  places host values on a mesh that spans processes and `local_view` shows this process its whole copy of arrays
  on such a mesh, so it can compute alone.
- Each process reads only the rows of a global batch that its own devices hold (`local_rows`, `global_batch`);
  `TokenWindows` cuts windows from a flat token array lazily, so a host touches only its windows.
- `allgather_f64` moves float64 host sums between processes exactly (as float32 hi/lo pairs), so reductions
  done on the host in float64 give every process the same bits.
- Dead peers: JAX's coordination service notices missing heartbeats (`heartbeat_timeout_s`) and terminates the
  surviving processes with "...detected fatal errors. This most likely indicates that another task died". A
  `Watchdog` is the backstop for a peer that is alive but stuck (its heartbeats continue, collectives never end).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from kvjax.config_flags import LaunchFlags
from kvjax.windows import sample_starts

log = logging.getLogger(__name__)

ENV_ADDRESS, ENV_NUM, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
EXIT_STALLED = 75  # exit status of a watchdog timeout (EX_TEMPFAIL: relaunch, the job resumes)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               mode: str = "auto", heartbeat_timeout_s: int = 30, init_timeout_s: int = 300,
               shutdown_timeout_s: int = 60, local_device_ids=None) -> bool:
    """Start JAX's distributed runtime; returns whether it is running (False: a single-process run).

    Arguments override the environment. With mode="auto" nothing starts unless a coordinator address is known.
    On CPU the cross-process collectives are gloo. Call this first: before any JAX computation or device query.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mode must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        return False
    if jax.distributed.is_initialized():
        return True
    coordinator = coordinator or os.environ.get(ENV_ADDRESS) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM)
    process_id = process_id if process_id is not None else _env_int(ENV_ID)
    if mode == "auto" and coordinator is None:
        if num_processes not in (None, 1):
            raise ValueError(f"{num_processes} processes but no coordinator address: pass --coordinator HOST:PORT "
                             f"(process 0's address) or set {ENV_ADDRESS}")
        return False
    if mode == "auto" and (num_processes is None or process_id is None):
        raise ValueError(f"coordinator {coordinator} given but not the process count and id: pass --num-processes "
                         f"and --process-id (or set {ENV_NUM} and {ENV_ID}), or use --distributed on on a cluster "
                         "JAX detects (SLURM, Cloud TPU)")
    from jax._src import xla_bridge  # private, but the only way to say *what* to do before JAX's own error
    if xla_bridge.backends_are_initialized():
        raise RuntimeError("kvjax.distributed.initialize must run before anything uses a JAX device (jax.devices(), "
                           "creating arrays, loading params); call it first in main()")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_device_ids,
                               initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=shutdown_timeout_s)
    log.info("process %d of %d: %d local devices, %d in all (coordinator %s)", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), coordinator or "detected")
    return True


def is_primary() -> bool:
    """Process 0: the one that writes reports, manifests and map artifacts."""
    return jax.process_index() == 0


# ---- which rows this process reads -------------------------------------------------------------------------------

def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The contiguous range of rows (axis 0) of a global array of `shape` that this process's devices hold."""
    spans = {(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
             for idx in sharding.addressable_devices_indices_map(tuple(shape)).values()}
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    covered = np.zeros(hi - lo, bool)
    for s, e in spans:
        covered[s - lo : e - lo] = True
    if not covered.all():
        raise ValueError(f"this process's devices hold non-contiguous rows {sorted(spans)} of {shape}; build the "
                         "mesh with kvjax.sharding.make_mesh (the 'data' axis must follow process order)")
    return slice(lo, hi)


def global_batch(rows, sharding: NamedSharding, shape: tuple[int, ...], dtype=np.int32) -> jax.Array:
    """A global array of `shape` with `sharding` from a row source (numpy array, memmap or TokenWindows) indexed
    by global row; only the rows this process holds are read. Rows past len(rows) are zero padding."""
    mine = local_rows(sharding, shape)
    real = slice(min(mine.start, len(rows)), min(mine.stop, len(rows)))
    local = np.zeros((mine.stop - mine.start,) + tuple(shape[1:]), dtype)
    if real.stop > real.start:
        local[: real.stop - real.start] = np.asarray(rows[real])
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))


class TokenWindows:
    """Windows [N, T] of a flat token array at given start offsets, read only when indexed (so each process reads
    only its own rows of a memory-mapped corpus). Slicing gives another TokenWindows; np.asarray reads."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, length: int):
        self.tokens, self.starts, self.length = tokens, np.asarray(starts, np.int64), int(length)
        if len(self.starts) and (self.starts.min() < 0 or self.starts.max() + self.length > len(tokens)):
            raise ValueError(f"window starts must lie in [0, {len(tokens) - self.length}] for {len(tokens)} tokens "
                             f"and windows of {self.length}")

    @classmethod
    def sample(cls, tokens: np.ndarray, n: int, length: int, seed: int = 0) -> "TokenWindows":
        """The same windows as kvjax.windows.sample(tokens, n, length, seed), unread."""
        return cls(tokens, sample_starts(len(tokens), n, length, seed), length)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.starts), self.length)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TokenWindows(self.tokens, self.starts[index], self.length)
        return np.asarray(self.tokens[self.starts[index] : self.starts[index] + self.length], np.int32)

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, np.int32)
        for i, s in enumerate(self.starts):
            out[i] = self.tokens[s : s + self.length]
        return out if dtype is None else out.astype(dtype)


# ---- exact host reductions across processes ----------------------------------------------------------------------

def allgather_f64(arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every process's float64 arrays, gathered on every process: result[p][i] is process p's arrays[i]. Sent as
    float32 hi + lo pairs (JAX runs without x64), which carry ~48 bits of the mantissa."""
    if jax.process_count() == 1:
        return [[np.asarray(a, np.float64) for a in arrays]]
    from jax.experimental import multihost_utils
    pairs = [split_f64(a) for a in arrays]
    got_hi, got_lo = multihost_utils.process_allgather(([h for h, _ in pairs], [lo for _, lo in pairs]), tiled=False)
    return [[join_f64(np.asarray(h[p]), np.asarray(lo[p])) for h, lo in zip(got_hi, got_lo)]
            for p in range(jax.process_count())]


def split_f64(a) -> tuple[np.ndarray, np.ndarray]:
    """float64 -> (hi, lo) float32 with hi + lo == a to ~48 bits (for moving float64 through float32 collectives)."""
    a = np.asarray(a, np.float64)
    hi = a.astype(np.float32)
    return hi, (a - hi.astype(np.float64)).astype(np.float32)


def join_f64(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return np.asarray(hi, np.float64) + np.asarray(lo, np.float64)


def broadcast_from_primary(tree):
    """Process 0's values of a pytree of host arrays, on every process (numpy leaves)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils
    return multihost_utils.broadcast_one_to_all(tree)


# ---- progress watchdog -------------------------------------------------------------------------------------------

_active: "Watchdog | None" = None


def heartbeat() -> None:
    """Mark progress (a batch or step finished) for the active Watchdog, if any. Library loops call this."""
    if _active is not None:
        _active.beat()


class Watchdog:
    """Exit the process (status 75) when no `heartbeat()` arrives for `timeout_s` seconds.

    JAX's own heartbeats catch a peer that *dies*; this catches one that hangs while alive, which would leave the
    others blocked in a collective forever. Use as a context manager around the work; timeout 0 disables it.
    """

    def __init__(self, timeout_s: float, what: str = "calibration batch or training step"):
        self.timeout_s, self.what = float(timeout_s), what
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvjax-watchdog", daemon=True)

    def beat(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                sys.stderr.write(
                    f"\nkvjax watchdog (process {jax.process_index()}): no {self.what} finished for {idle:.0f} s "
                    f"(--step-timeout {self.timeout_s:g}). A peer process has probably died or hung; see the other "
                    f"processes' logs. Exiting with status {EXIT_STALLED}; relaunch to resume from the last "
                    "checkpoint.\n")
                sys.stderr.flush()
                os._exit(EXIT_STALLED)

    def __enter__(self) -> "Watchdog":
        global _active
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread.start()
            _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self._stop.set()
        if _active is self:
            _active = None


# ---- the main job's command line ---------------------------------------------------------------------------------

# LaunchFlags and split_launch_flags live in kvjax.config_flags: the command line reads them before JAX starts


def initialize_from_flags(flags: LaunchFlags) -> bool:
    return initialize(flags.coordinator, flags.num_processes, flags.process_id, mode=flags.distributed,
                      heartbeat_timeout_s=flags.heartbeat_timeout, init_timeout_s=flags.init_timeout)


# ---- one job over many processes: who works, who waits -----------------------------------------------------------

_barriers = 0
WAIT_S = 48 * 3600  # a process waits this long for the others (e.g. while process 0 alone evaluates); a peer that
# dies meanwhile ends the wait sooner through JAX's heartbeats


def wait_all(name: str, timeout_s: float = WAIT_S) -> None:
    """All processes wait here (no-op with one). Unlike `barrier`, it runs no device computation: it waits in the
    coordination service, so a process may wait for hours while process 0 works alone. Every process must reach the
    same calls in the same order."""
    global _barriers
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the coordination client: the only host-side barrier
    _barriers += 1
    jax_distributed.global_state.client.wait_at_barrier(f"kvjax/{_barriers}/{name}", int(timeout_s * 1000))


def primary_first(name: str, fn, error: type[Exception] = RuntimeError):
    """Run `fn()` on process 0, then, once it returned, on the others (e.g. process 0 deletes what --redo discards
    before the others look). If it raised on process 0, the others raise `error` with its message instead of
    running it, so every process stops the same way."""
    if jax.process_count() == 1:
        return fn()
    from jax._src import distributed as jax_distributed
    client, key = jax_distributed.global_state.client, f"kvjax/primary_first/{name}"
    if is_primary():
        try:
            out = fn()
        except Exception as e:
            client.key_value_set(key, f"error:{e}")
            raise
        client.key_value_set(key, "ok")
        return out
    outcome = client.blocking_key_value_get(key, WAIT_S * 1000)
    if outcome != "ok":
        raise error(f"process 0 stopped: {outcome[len('error:'):]}")
    return fn()


def replicate(tree, mesh):
    """Host (or single-device) arrays as arrays replicated over `mesh`, which may span processes; every process
    must pass the same values."""
    sharding = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def leaf(x):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree.map(leaf, tree)


def local_view(tree, mesh):
    """Arrays on a mesh that spans processes, as the same device buffers on this process's part of it
    (`mesh.local_mesh`), so this process can compute with them alone. Each array must be whole on every process:
    split only over mesh axes that stay within a process (the model axis), not over 'data' across processes."""
    local = mesh.local_mesh

    def leaf(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        spec = x.sharding.spec
        for axes in spec:
            for axis in (axes if isinstance(axes, tuple) else (axes,)):
                if axis is not None and local.shape[axis] != mesh.shape[axis]:
                    raise ValueError(f"an array of shape {x.shape} is split over mesh axis {axis!r} across processes "
                                     f"({spec}); no process holds all of it. Keep the '{axis}' axis within one host "
                                     "(--config.mesh.model <= devices per process)")
        shards = {s.device: s.data for s in x.addressable_shards}
        sharding = NamedSharding(local, spec)
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [shards[d] for d in sharding.addressable_devices_indices_map(x.shape)])
    return jax.tree.map(leaf, tree)
