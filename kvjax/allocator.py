"""The host allocator settings kvjax's programs run under on CPU.

XLA:CPU allocates each execution's temporaries afresh (the attention window's K/V slice of every layer, the logits) and
frees them at its end. Under glibc's defaults a block above the mmap threshold (at most 32 MB) is an mmap of its own,
each XLA worker thread allocates from a separate arena that shrinks when freed, and the main heap is trimmed back to the
OS: so every decode step page-faults its temporaries back in, at ~2 GB/s instead of the ~20 GB/s the same bytes read at
from memory already mapped. At batch 64 and 512 tokens a row, that was 2/3 of the step (355 vs 112 ms on the foundation
model, 2026-12-01; docs/performance.md, "The host allocator"). Keeping freed memory in one heap (no mmap'd blocks, no
trimming, one arena) removes the faults; the single arena costs ~10% at batch 1 (its lock), which is why tcmalloc, where
installed and preloaded (LD_PRELOAD; docs/performance.md), is better still and is left alone.

`tune()` applies this with glibc's mallopt. It changes the whole process (memory freed is kept for reuse, so the
resident size stays at its peak), which is right for the programs kvjax runs (the main job, the server, the
benchmarks) and not for a library import: those programs call it first thing in main(), before XLA starts its
threads (an arena set up earlier keeps its own behaviour). KVJAX_MALLOC=system leaves the defaults.

Transparent huge pages. A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB (117 MB
of weights: ~30,000 page walks a token). Where the kernel gives huge pages only on request (THP "madvise", the common
default), glibc's malloc asks for them when the process starts with the tunable GLIBC_TUNABLES=glibc.malloc.hugetlb=1
(glibc >= 2.35): measured on the foundation model, one core, decode at 512 / 2,000 tokens of context +16% / +41% (the
generate loop), the same logits (2026-12-01, `python -m launch.bench.foundation --cpus 1`). Tunables are read
once, when a process starts, so mallopt cannot set this one: `environ()` is the environment to start a kvjax program (or
a benchmark's worker) under, and `reexec()`, called by a program's entry point before any work (the main job and the
server first check their command line, which needs no JAX, so a mistake is reported without a restart), restarts the
program under it once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
ENV = "KVJAX_MALLOC"
TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"  # 1: malloc madvises its heap and mmap'd blocks for transparent huge pages
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

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
    return f"glibc {version}: one arena, no mmap'd blocks, no trimming, {_huge_pages(version)}"


def _huge_pages(glibc_version: str) -> str:
    """What this process got for huge pages, for tune()'s report."""
    mode = thp_mode()
    if mode == "always":
        return "transparent huge pages (the kernel's default: always)"
    if mode != "madvise":
        return f"no transparent huge pages (kernel setting: {mode or 'unknown'})"
    value = _hugetlb(os.environ.get(TUNABLES, ""))
    if value == "1" and _version(glibc_version) >= (2, 35):
        return f"transparent huge pages ({TUNABLES}={HUGETLB}=1)"
    if value is not None:
        return f"no transparent huge pages ({TUNABLES}={HUGETLB}={value})"
    return f"no transparent huge pages (start the program with {TUNABLES}={HUGETLB}=1; glibc >= 2.35)"


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (0,)


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page setting ("always", "madvise", "never"), None where unreadable."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _hugetlb(tunables: str) -> str | None:
    """The value GLIBC_TUNABLES gives glibc.malloc.hugetlb, None when it gives none."""
    for item in tunables.split(":"):
        name, _, value = item.partition("=")
        if name == HUGETLB:
            return value
    return None


def environ(env=None) -> dict:
    """A copy of `env` (default os.environ) to start a kvjax program or a benchmark's worker under: with
    glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES where it helps (Linux, the kernel's THP setting "madvise", the
    tuned allocator: not under KVJAX_MALLOC=system, nor when the tunable is already set either way)."""
    env = dict(os.environ if env is None else env)
    if (env.get(ENV, "tuned") != "tuned" or not sys.platform.startswith("linux") or thp_mode() != "madvise"
            or _hugetlb(env.get(TUNABLES, "")) is not None):
        return env
    env[TUNABLES] = ":".join(x for x in (env.get(TUNABLES, ""), f"{HUGETLB}=1") if x)
    return env


def reexec() -> None:
    """Restart this program under `environ()` when it did not start under it; a no-op when it did (so it restarts
    once). For a program's entry point (`if __name__ == "__main__"`), before any work: never from a library import,
    and never in a process that has done work it would repeat (checking the command line, which the restarted
    process repeats in well under a second, is fine)."""
    env = environ()
    if env.get(TUNABLES) == os.environ.get(TUNABLES):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
