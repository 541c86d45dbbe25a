"""The accelerators a plan is made for: each TPU generation's published per-chip figures, and the devices of a slice
by name ("v5e:2x4"), without the hardware.

A slice's devices come from the TPU compiler (libtpu, `pip install "kvjax[tpu]"`) through
`jax.experimental.topologies.get_topology_desc`, which needs no TPU: JAX then compiles for them on this machine's
CPU. "cpu:N" names N of this process's CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N` makes fake
ones): a plan of a toy config for what a CPU run holds, with `memory_gb` standing in for the HBM the CPU does not have.

Per chip, from Google's Cloud TPU documentation: HBM capacity, HBM bandwidth, peak bf16 dense FLOP/s. v4 and v5p chips
hold two TensorCores; v5p runs them as one device (megacore), v4 slices as named here list each core as a device, so
a device there holds half a chip's HBM and bandwidth.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re


class PlanError(Exception):
    """A problem with what the plan was asked for; the message says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class Chip:
    generation: str  # "v5e"
    hbm_gb: float  # HBM per chip, GB (1e9 bytes)
    hbm_gbps: float  # HBM bandwidth per chip, GB/s
    tflops: float  # peak bf16 dense TFLOP/s per chip
    dims: int  # 2 (a 2D torus: "2x4") or 3 ("2x2x2")
    ladder: tuple[str, ...]  # slice shapes, smallest first (for "the smallest slice that fits")


CHIPS = {
    "v4": Chip("v4", 32, 1200, 275, 3, ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")),
    "v5e": Chip("v5e", 16, 819, 197, 2, ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    "v5p": Chip("v5p", 95, 2765, 459, 3, ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8")),
    "v6e": Chip("v6e", 32, 1640, 918, 2, ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A named set of devices and what each device holds and moves."""

    name: str  # "v5e:2x4" or "cpu:8"
    devices: tuple  # jax devices (TPU devices of a topology description, or CPU devices)
    chips: int
    hbm_bytes: float  # per device
    hbm_bytes_per_s: float  # per device
    flops_per_s: float  # per device, bf16 peak
    chip: Chip | None  # None for CPU devices

    @property
    def platform(self) -> str:
        return "cpu" if self.chip is None else "tpu"

    def describe_short(self) -> str:
        kind = self.devices[0].device_kind if self.devices else "?"
        return f"each of {len(self.devices)} {kind} devices"

    def describe(self) -> str:
        if self.chip is None:
            return f"{self.name}: {len(self.devices)} CPU devices, {self.hbm_bytes / 1e9:.1f} GB each (as given)"
        per = len(self.devices) // self.chips
        return (f"{self.name}: {self.chips} {self.chip.generation} chips ({len(self.devices)} devices), "
                f"{self.hbm_bytes / 1e9:.0f} GB HBM and {self.hbm_bytes_per_s / 1e9:.0f} GB/s per device"
                f"{' (one TensorCore of a chip)' if per > 1 else ''}")


_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")


def no_tpu_here() -> bool:
    """True when this machine has no TPU chips (compile-only planning)."""
    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def compile_only_environment() -> None:
    """Settings for planning on a machine without TPU chips, before JAX starts: libtpu guards its chips with a
    lockfile that would let one process plan at a time; with no chips there is nothing to guard."""
    if no_tpu_here():
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        # libtpu looks for the host's own TPU type and workers when it loads and logs a page of errors without them;
        # the slices a plan compiles for are named explicitly (get_topology_desc), so any valid answer does
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")


def parse(name: str) -> tuple[str, tuple[int, ...]]:
    m = _NAME.match(name.strip())
    if not m:
        raise PlanError(f"topology {name!r}: use GEN:SHAPE with GEN one of {', '.join(CHIPS)} (e.g. v5e:2x4, "
                        "v6e:4x4, v5p:2x2x2), or cpu:N for N CPU devices")
    gen, shape = m.group(1), tuple(int(x) for x in m.group(2).split("x"))
    if len(shape) != CHIPS[gen].dims:
        raise PlanError(f"topology {name!r}: {gen} slices have {CHIPS[gen].dims} dimensions (e.g. "
                        f"{gen}:{CHIPS[gen].ladder[1]})")
    return gen, shape


def tpu_slice(name: str) -> Slice:
    """The devices of a TPU slice, from the TPU compiler (no TPU needed)."""
    gen, shape = parse(name)
    chip = CHIPS[gen]
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise PlanError("planning for TPU needs the TPU compiler (libtpu), which is not installed: "
                        "pip install 'kvjax[tpu]' (or run through `KVJAX_EXTRA=plan launch/venv python -m kvjax.plan`)"
                        ) from None
    from jax.experimental import topologies
    kwargs = {}
    if math.prod(shape) == 1:  # one chip: a host of one chip (the default host is 2x2)
        kwargs["chips_per_host_bounds"] = (1, 1, 1)
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)
    except Exception as e:  # the compiler's own words: a shape it does not know
        raise PlanError(f"topology {name!r}: the TPU compiler refused it ({str(e).splitlines()[0][:200]}); try one "
                        f"of {', '.join(f'{gen}:{s}' for s in chip.ladder)}") from None
    devices = tuple(topo.devices)
    chips = math.prod(shape)
    per_chip = max(1, len(devices) // chips)
    return Slice(name, devices, chips, chip.hbm_gb * 1e9 / per_chip, chip.hbm_gbps * 1e9 / per_chip,
                 chip.tflops * 1e12 / per_chip, chip)


def cpu_slice(n: int, memory_gb: float) -> Slice:
    """n of this process's CPU devices, each given `memory_gb` (a CPU device has no HBM of its own)."""
    import jax
    devices = jax.devices("cpu")
    if n > len(devices):
        raise PlanError(f"cpu:{n} needs {n} CPU devices and this process has {len(devices)}; set "
                        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting")
    return Slice(f"cpu:{n}", tuple(devices[:n]), n, memory_gb * 1e9, 20e9, 1e12, None)


MARGIN_NOTE = "weights and inputs only: XLA's temporaries come on top"


def device_slice(devices, memory_bytes: float) -> Slice:
    """The devices at hand (a running job's), each offering `memory_bytes`; FLOP/s and bandwidth unknown."""
    devices = tuple(devices)
    kind = devices[0].device_kind if devices else "?"
    return Slice(f"{len(devices)} x {kind}", devices, len(devices), memory_bytes, 0.0, 0.0, None)


def get_slice(name: str, cpu_memory_gb: float = 16.0) -> Slice:
    if name.startswith("cpu:"):
        try:
            n = int(name[4:])
        except ValueError:
            raise PlanError(f"topology {name!r}: use cpu:N with N a number of CPU devices") from None
        return cpu_slice(n, cpu_memory_gb)
    return tpu_slice(name)


def ladder(generation: str) -> tuple[str, ...]:
    """The slice names of a generation, smallest first."""
    if generation not in CHIPS:
        raise PlanError(f"generation {generation!r}: use one of {', '.join(CHIPS)}")
    return tuple(f"{generation}:{s}" for s in CHIPS[generation].ladder)
