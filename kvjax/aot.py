"""The library's compiled programs, named: `jit` is jax.jit for every program kvjax compiles, and `recording` lists
the programs a piece of work calls.

Why a seam of our own around jax.jit: kvjax.plan compiles ahead of time, for hardware this machine does not have,
the programs the main job and the server run, and a plan is only worth reading if it holds every one of them. Each
program is named by where it is defined (`module.qualname`), so a test can run a small job under `recording()` and
check that the plan of the same config names every program the job called (tests/test_plan.py): a new program added
to a stage without its plan fails there, not on a user's slice.

A `Jitted` is the jax.jit of its function (`lower`, `eval_shape`, ... are jax.jit's); calling it costs one check of a
module-level list when nothing records.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import jax

_RECORDERS: list["Recorder"] = []
_SECTION: list[str] = []


class Recorder:
    """The programs called while it was active: `calls[(section, program name)]` counts the calls (section: the
    innermost `section()` label, "" outside any). With `memory`, also `live[section]`: the most bytes of live arrays
    one device held right after a program returned (its outputs and everything kept beside them; what a run holds,
    for checking a plan against it). Reading every live array after each call is slow: for tests."""

    def __init__(self, memory: bool = False):
        self.calls: dict[tuple[str, str], int] = {}
        self.memory = memory
        self.live: dict[str, int] = {}

    def add(self, name: str) -> None:
        key = (_SECTION[-1] if _SECTION else "", name)
        self.calls[key] = self.calls.get(key, 0) + 1

    def measure(self) -> None:
        section = _SECTION[-1] if _SECTION else ""
        self.live[section] = max(self.live.get(section, 0), live_bytes_per_device())

    @property
    def names(self) -> set[str]:
        return {name for _, name in self.calls}

    def by_section(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for section, name in self.calls:
            out.setdefault(section, set()).add(name)
        return out


class Jitted:
    """jax.jit(fn, **options), named `module.qualname` of fn (its `name`)."""

    def __init__(self, fn: Callable, **options):
        self.fn = fn
        self.name = program_name(fn)
        self.jitted = jax.jit(fn, **options)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if not _RECORDERS:
            return self.jitted(*args, **kwargs)
        for r in _RECORDERS:
            r.add(self.name)
        out = self.jitted(*args, **kwargs)
        if any(r.memory for r in _RECORDERS):
            jax.block_until_ready(out)
            for r in _RECORDERS:
                if r.memory:
                    r.measure()
        return out

    def __getattr__(self, attr):
        return getattr(self.jitted, attr)

    def __repr__(self) -> str:
        return f"<kvjax program {self.name}>"


def program_name(fn: Callable) -> str:
    """`module.qualname` of a function (a closure's qualname holds the function that made it)."""
    fn = getattr(fn, "fn", fn)
    while isinstance(fn, functools.partial):
        fn = fn.func
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def jit(fn: Callable | None = None, **options):
    """jax.jit(fn, **options) as a named kvjax program; usable as a decorator, bare or with options."""
    if fn is None:
        return functools.partial(jit, **options)
    return Jitted(fn, **options)


def live_bytes_per_device() -> int:
    """The most bytes of live jax arrays any one device holds now (each array's shard on it; two arrays over one
    buffer, as a placement that moves nothing makes, counted once)."""
    per: dict = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            data = shard.data
            try:
                buffer = data.unsafe_buffer_pointer()
            except Exception:  # a backend without raw pointers: count the array itself
                buffer = id(data)
            per.setdefault(shard.device, {})[buffer] = data.nbytes
    return max((sum(b.values()) for b in per.values()), default=0)


@contextlib.contextmanager
def recording(memory: bool = False) -> Iterator[Recorder]:
    """Record every kvjax program called inside the block (in this process); `memory`: see Recorder."""
    recorder = Recorder(memory)
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


@contextlib.contextmanager
def section(label: str) -> Iterator[None]:
    """Label the programs called inside the block (a stage of the job) for any active recorder."""
    _SECTION.append(label)
    try:
        yield
    finally:
        _SECTION.pop()
