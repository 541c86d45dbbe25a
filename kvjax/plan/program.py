"""One program of a plan: a library function compiled by `kvjax.aot.jit`, the abstract arguments the job would call
it with on a slice, and what the shapes say it must compute and move; compiling it gives XLA's own account.

The arithmetic (`flops`, `hbm_bytes`, kvjax.plan.costs) is what the shapes require: matmul and attention FLOPs, and
the bytes a step cannot avoid moving through HBM (weights read once, the cache's live part read, what is written).
XLA's cost analysis counts differently — every instruction's operands and outputs, each branch of a conditional
(decode attention picks one of several window sizes with lax.switch, and the count sums them all) — so it is
reported beside the arithmetic, as a check, and the priced time (`roofline`) is taken from the arithmetic.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from jax.sharding import Mesh

from kvjax.aot import program_name
from kvjax.plan.hardware import Slice


@dataclasses.dataclass
class Program:
    stage: str  # the job's stage ("ridge", "mc", ...) or "serve"
    name: str  # what it computes, with its shapes: "source prefill 4 x 1024"
    fn: Any  # the library's compiled function (kvjax.aot.jit / kvjax.cache.cache_jit)
    args: tuple
    kwargs: dict
    mesh: Mesh
    flops: float  # per device, by the arithmetic of the shapes (kvjax.plan.costs)
    hbm_bytes: float  # per device: what one call must move through HBM (kvjax.plan.costs)
    holds: tuple[str, ...] = ()  # the models whose weights are arguments ("source", "target", "encoder", ...)
    weight_bytes: int = 0  # per device: those weights (the plan counts each model once per stage)
    note: str = ""
    # per device: what the stage keeps alive beside this program's own buffers while it runs (e.g. the source's
    # cache a shared prefill keeps while each map reads it, the references an evaluation compares every arm with)
    kept_bytes: int = 0

    @property
    def program(self) -> str:
        """The library's name of the compiled function (kvjax.aot)."""
        return program_name(self.fn)

    def key(self) -> tuple:
        """What makes two programs one compile: the function, the abstract arguments, the static ones."""
        leaves, tree = jax.tree.flatten((self.args, self.kwargs))
        sig = tuple((tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
                    if isinstance(x, jax.ShapeDtypeStruct) else repr(x) for x in leaves)
        return (self.program, str(tree), sig)


@dataclasses.dataclass
class Compiled:
    """A program compiled for a slice: XLA's memory analysis per device, its cost analysis, and timings."""

    program: Program
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    xla_flops: float = 0.0
    xla_bytes: float = 0.0
    error: str = ""  # the compiler's refusal, if it refused
    reused: bool = False  # the same compile served an earlier program of the plan
    compiled: bool = False  # False: lowered only (the figures above are not XLA's)

    @property
    def peak_bytes(self) -> int:
        """Device memory the program needs while it runs: its arguments, outputs not written in place of a donated
        argument, and temporaries (XLA's memory analysis; the generated code is on the side)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def working_bytes(self) -> int:
        """The program's memory beside the weights it reads (outputs, temporaries, caches and other inputs), and
        what the stage keeps alive beside it."""
        return self.peak_bytes - self.program.weight_bytes + self.program.kept_bytes

    def roofline_seconds(self, sl: Slice) -> float:
        """The least time one call can take on the slice: its FLOPs at the chip's peak or its bytes at the HBM
        bandwidth, whichever is longer (collectives and launch overheads not counted: a lower bound)."""
        return max(self.program.flops / sl.flops_per_s, self.program.hbm_bytes / sl.hbm_bytes_per_s)

    def bound(self, sl: Slice) -> str:
        return "compute" if self.program.flops / sl.flops_per_s >= self.program.hbm_bytes / sl.hbm_bytes_per_s \
            else "memory"


def compile_program(p: Program, compile: bool = True) -> Compiled:
    """Lower and compile `p` for its mesh's devices (no device needed: a TPU topology's devices compile here); without
    `compile`, lower only (a check that the program builds at these shapes, in a fraction of the time)."""
    out = Compiled(p)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(p.mesh):
            lowered = p.fn.lower(*p.args, **p.kwargs)
        t1 = time.perf_counter()
        if not compile:
            out.lower_seconds = t1 - t0
            return out
        compiled = lowered.compile()
    except Exception as e:  # the compiler's refusal is a result of the plan, reported per program
        out.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        out.lower_seconds = time.perf_counter() - t0
        return out
    out.lower_seconds, out.compile_seconds = t1 - t0, time.perf_counter() - t1
    out.compiled = True
    mem = compiled.memory_analysis()
    if mem is not None:
        out.argument_bytes = int(mem.argument_size_in_bytes)
        out.output_bytes = int(mem.output_size_in_bytes)
        out.alias_bytes = int(mem.alias_size_in_bytes)
        out.temp_bytes = int(mem.temp_size_in_bytes)
        out.code_bytes = int(getattr(mem, "generated_code_size_in_bytes", 0) or 0)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    out.xla_flops = float(cost.get("flops", 0.0))
    out.xla_bytes = float(cost.get("bytes accessed", 0.0))
    del lowered, compiled
    jax.clear_caches()  # a plan compiles each program once: the traces and executables JAX keeps would pile up (GBs)
    return out
