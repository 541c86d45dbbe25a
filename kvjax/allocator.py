"""The host allocator settings kvjax's programs run under on CPU.

XLA:CPU allocates each execution's temporaries afresh (the attention window's K/V slice of every layer, the logits)
and frees them at its end. Under glibc's defaults a block above the mmap threshold (at most 32 MB) is an mmap of its
own, each XLA worker thread allocates from a separate arena that shrinks when freed, and the main heap is trimmed back
to the OS: so every decode step page-faults its temporaries back in, at ~2 GB/s instead of the ~20 GB/s the same bytes
read at from memory already mapped. At batch 64 and 512 tokens a row, that was 2/3 of the step (355 vs 112 ms on the
foundation model; WORKSPACE.md, "Speed"). Keeping freed memory in one heap (no mmap'd blocks, no trimming, one arena)
removes the faults; the single arena costs ~10% at batch 1 (its lock), which is why tcmalloc, where installed and
preloaded (LD_PRELOAD; README, "Speed on CPU"), is better still and is left alone.

`tune()` applies this with glibc's mallopt. It changes the whole process (memory freed is kept for reuse, so the
resident size stays at its peak), which is right for the programs kvjax runs (the main job, the server, the
benchmarks) and not for a library import: those programs call it first thing in main(), before XLA starts its
threads (an arena set up earlier keeps its own behaviour). KVJAX_MALLOC=system leaves the defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
ENV = "KVJAX_MALLOC"

_applied: str | None = None


def tune() -> str:
    """Apply the settings (once per process) and return what was done, for the run's log: "glibc: ..." or why not."""
    global _applied
    if _applied is not None:
        return _applied
    choice = os.environ.get(ENV, "tuned")
    if choice not in ("tuned", "system"):
        raise ValueError(f"{ENV}={choice!r}: use 'tuned' (the default) or 'system' (the C library's defaults)")
    if choice == "system":
        _applied = f"system allocator defaults ({ENV}=system)"
    elif not sys.platform.startswith("linux"):
        _applied = f"system allocator defaults ({sys.platform}: the settings are glibc's)"
    elif (other := _preloaded()) is not None:
        _applied = f"{other} (loaded into the process; left as it is)"
    else:
        _applied = _mallopt()
    return _applied


def _preloaded() -> str | None:
    """tcmalloc or jemalloc when the process runs under one (LD_PRELOAD): it already keeps freed memory."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return None


def _mallopt() -> str:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        gnu = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return "system allocator defaults (not glibc)"
    gnu.restype = ctypes.c_char_p
    ok = all(libc.mallopt(option, value) == 1 for option, value in
             ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1), (M_ARENA_MAX, 1)))
    version = gnu().decode()
    if not ok:
        return f"glibc {version}: mallopt refused a setting; allocator defaults kept in part"
    return f"glibc {version}: one arena, no mmap'd blocks, no trimming"
