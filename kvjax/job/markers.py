"""A run directory's stage markers: each finished stage leaves a marker (stages/NAME.json) holding a hash of everything
it depends on (its settings, the identity of the models, upstream stages). A rerun skips a stage whose marker
matches, redoes one that never finished, and refuses (before any work) one made with other settings, unless the
user asks to redo it.

In a multi-process run every process reads the run directory but one writes it (`writer`): markers, deletions for
--redo and claimed work directories are process 0's; `sync` (kvjax.distributed.wait_all) makes the others wait
until a claimed work directory is ready.

What is under a final name is whole: every writer of the stages writes a temporary name and renames it (write_json,
the data directory, kvjax.save_map, the report's files and charts; orbax commits a checkpoint by renaming its
temporary directory), and a stage's marker is written last. A stage killed at any moment, or whose write the disk
refuses, is therefore redone by the rerun, from its start or (the residual) from its last checkpoint. The stages
run inside `RunDir.writing`, which turns a refused write into one line (kvjax.job.disk) and removes what the
stage left under temporary names.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import time

from kvjax.config_flags import flatten
from kvjax.job import disk


class StageConflict(ValueError):
    """A finished stage in the run directory was made with different settings."""


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(path: str) -> dict:
    """What identifies a checkpoint directory cheaply: config/tokenizer contents, weight file sizes and mtimes."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith((".json",)) and os.path.getsize(full) < 50_000_000:
            with open(full, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()[:16]
        elif name.endswith(".safetensors"):
            st = os.stat(full)
            out[name] = [st.st_size, st.st_mtime_ns]
    return out


def write_json(path: str, obj) -> None:
    """Atomic JSON write (a reader never sees half a file; a failed write leaves nothing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=float)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


class Stage:
    def __init__(self, name: str, settings: dict, upstream: list["Stage"], outputs: list[str]):
        self.name = name
        self.settings = settings  # what this stage depends on (JSON-able)
        self.upstream = upstream
        self.outputs = outputs  # paths (relative to the run dir) this stage writes
        self.hash = digest({"settings": settings, "upstream": [u.hash for u in upstream]})


class RunDir:
    def __init__(self, root: str, writer: bool = True, sync=None):
        self.root = root
        self.writer = writer  # this process writes markers and deletes outputs (process 0 of a multi-process run)
        self.sync = sync or (lambda name: None)  # all processes wait here (called with a name)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def marker(self, stage: Stage) -> str:
        return self.path("stages", f"{stage.name}.json")

    def done(self, stage: Stage) -> bool:
        """True if the stage finished with these settings; False if it never finished. Raises StageConflict if it
        finished with other settings."""
        path = self.marker(stage)
        if not os.path.isfile(path):
            return False
        old = read_json(path)
        if old["hash"] == stage.hash:
            return True
        raise StageConflict(self._conflict(stage, old))

    def _conflict(self, stage: Stage, old: dict) -> str:
        new, before = flatten(stage.settings), flatten(old.get("settings", {}))
        changed = [f"{k}: {before.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(new) | set(before))
                   if new.get(k) != before.get(k)]
        why = ("; ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")) if changed else \
            "an earlier stage it depends on changed"
        return (f"{self.root} already holds a finished '{stage.name}' stage made with other settings ({why}). "
                f"Pass --redo={stage.name} to recompute it and the stages after it, or use another "
                f"--config.output_dir.")

    def seconds(self, stage: Stage) -> float | None:
        path = self.marker(stage)
        return read_json(path).get("seconds") if os.path.isfile(path) else None

    def finish(self, stage: Stage, seconds: float, cpu_seconds: float | None = None) -> None:
        if not self.writer:
            return
        write_json(self.marker(stage), {"stage": stage.name, "hash": stage.hash, "settings": stage.settings,
                                        "upstream": {u.name: u.hash for u in stage.upstream}, "seconds": seconds,
                                        "cpu_seconds": cpu_seconds,
                                        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")})

    def forget(self, stage: Stage) -> None:
        """Remove a stage's marker and outputs (for --redo)."""
        if not self.writer:
            return
        if os.path.isfile(self.marker(stage)):
            os.remove(self.marker(stage))
        for out in stage.outputs:
            full = self.path(out)
            if os.path.isdir(full):
                shutil.rmtree(full)
            elif os.path.isfile(full):
                os.remove(full)

    @contextlib.contextmanager
    def writing(self, stage: Stage | None, what: str = ""):
        """Run a stage's work and its marker's write (or, stage None, the writing of `what`) inside: a write the
        disk refuses (full, read-only, not permitted: kvjax.job.disk.failed_write) raises disk.WriteFailed, one
        line naming the device, the path and the stage, once the writer has removed what the stage left under
        temporary names (its outputs' and its marker's `.tmp`, the report's `.tmp.png` charts, orbax's
        `.orbax-checkpoint-tmp` directories), which hold the space a rerun needs."""
        try:
            yield
        except Exception as e:
            failed = disk.failed_write(e, self.root)
            if failed is None:
                raise
            message = disk.describe(*failed, stage.name if stage else what, self.root)  # the free space now
            if self.writer and stage is not None:
                self._sweep(stage)
            raise disk.WriteFailed(message) from None

    def _sweep(self, stage: Stage, tries: int = 20) -> None:
        """Remove what `stage` left under temporary names. A failed orbax save may still have writes in flight
        (TensorStore's, which orbax stopped waiting for at the first failure): they can recreate a directory being
        removed, so the sweep repeats until nothing is left twice in a row (they fail fast on the same disk)."""
        clean = 0
        for _ in range(tries):
            left = [p for p in [self.path(out) + ".tmp" for out in stage.outputs] + [self.marker(stage) + ".tmp"]
                    if os.path.lexists(p)]
            left += glob.glob(self.path("*.tmp.png"))
            for out in stage.outputs:
                left += glob.glob(os.path.join(glob.escape(self.path(out)), "**", "*.orbax-checkpoint-tmp*"),
                                  recursive=True)
            clean = 0 if left else clean + 1
            if clean == 2:
                return
            for path in left:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.remove(path)
            time.sleep(0.05)

    def claim_workdir(self, stage: Stage, workdir: str) -> None:
        """A resumable stage's work directory belongs to these settings: partial work from other settings is
        discarded; partial work from the same settings is kept (and resumed). Every process calls it; they return
        once the writer has decided."""
        if self.writer:
            self._claim(stage, workdir)
        self.sync(f"claim {workdir}")

    def _claim(self, stage: Stage, workdir: str) -> None:
        stamp = os.path.join(workdir, "stage_hash")
        if os.path.isfile(stamp):
            with open(stamp) as f:
                if f.read().strip() == stage.hash:
                    return
        if os.path.isdir(workdir):
            shutil.rmtree(workdir)
        os.makedirs(workdir)
        with open(stamp + ".tmp", "w") as f:
            f.write(stage.hash)
        os.replace(stamp + ".tmp", stamp)
