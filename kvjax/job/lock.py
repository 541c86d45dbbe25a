"""One job per run directory: an advisory lock on RUN/.lock, held for the job's life.

The lock is flock(2) on an open file: the kernel releases it when the holding process ends, however it ends, so a
SIGKILLed job leaves no stale lock and its directory is usable at once (the file itself stays, naming its last
holder). The holder writes who it is into the file (pid, host, start time, command); a second job finds the lock
taken and refuses at once, naming the holder. On Linux, flock on NFS is carried by the server's byte-range locks, so
jobs on two hosts sharing a run directory exclude each other too.

Only `python -m kvjax.launch` takes it (process 0 of a multi-process job: the process that writes the run
directory); readers (the server, a user reading metrics.json) never need it. No JAX here: the command takes the lock
before JAX starts, so a refusal is reported in a fraction of a second with nothing else done.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time

from kvjax.run.preflight import LaunchError
from kvjax.job import disk

LOCK = ".lock"
# the lock's descriptor number, handed across the command's one restart under the allocator settings (os.execve keeps
# an inheritable descriptor open, and with it the lock): the restarted process adopts it instead of locking again
ENV_FD = "KVJAX_RUN_LOCK_FD"


class RunDirInUse(LaunchError):
    """Another job holds the run directory's lock."""


class RunLock:
    """A held lock on a run directory (`acquire`). `release` (or the process's end) gives it up."""

    def __init__(self, root: str, fd: int, created: bool):
        self.root, self.fd = root, fd
        self.created = created  # `acquire` made the directory: `release` removes it if nothing else was written

    @property
    def path(self) -> str:
        return os.path.join(self.root, LOCK)

    def release(self) -> None:
        """Give up the lock. A directory made by `acquire` that still holds nothing but the lock file (the job was
        refused before any work: a config error, a conflict, too little space) is removed, lock file and all."""
        if self.fd < 0:
            return
        try:
            if self.created and os.listdir(self.root) == [LOCK]:
                # unlinked while still held: a job starting now locks a new file, never a removed one
                os.unlink(self.path)
                os.rmdir(self.root)
        except OSError:
            pass  # another job has just started writing here: the directory is its
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1

    def keep_over_exec(self) -> None:
        """Let the next os.execve of this process keep the lock (`acquire` in the new program adopts it)."""
        os.set_inheritable(self.fd, True)
        os.environ[ENV_FD] = f"{self.fd}:{int(self.created)}"

    def stay(self) -> None:
        """Undo `keep_over_exec` (the process did not restart after all)."""
        os.set_inheritable(self.fd, False)
        os.environ.pop(ENV_FD, None)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(root: str, command: list[str] | None = None) -> RunLock:
    """Lock the run directory `root` (created if missing) for this process, or raise RunDirInUse naming the holder.
    Never waits. A disk that refuses the lock file (read-only, full, not permitted) raises disk.WriteFailed."""
    path = os.path.join(root, LOCK)
    adopted = _adopt(path)
    if adopted is not None:
        return RunLock(root, *adopted)
    created = not os.path.isdir(root)
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        failed = disk.failed_write(e, root)
        if failed is None:
            raise
        raise disk.WriteFailed(disk.describe(*failed, "locking the run directory", root)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(in_use(root, holder(root))) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": shlex.join(command if command is not None else [sys.executable, *sys.orig_argv[1:]])}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, only its holder goes unnamed (the space check follows)
    return RunLock(root, fd, created)


def _adopt(path: str) -> tuple[int, bool] | None:
    """(descriptor, created) of the lock on `path` a restarted command inherited, or None."""
    value = os.environ.pop(ENV_FD, None)
    if value is None:
        return None
    try:
        fd, _, created = value.partition(":")
        fd = int(fd)
        mine, there = os.fstat(fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # already ours: a no-op that fails if it is not
        os.set_inheritable(fd, False)
        return fd, created == "1"
    except (ValueError, OSError):
        return None


def holder(root: str) -> dict | None:
    """Who holds (or last held) the lock of `root`, as its holder wrote it; None when unreadable."""
    for _ in range(10):  # the holder writes it right after locking: give an instant write time to land
        try:
            with open(os.path.join(root, LOCK)) as f:
                text = f.read()
            if text.strip():
                return json.loads(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return None


def in_use(root: str, who: dict | None) -> str:
    """The refusal: one line naming the holder and what to do."""
    if who is None:
        by = "another job (its holder did not write its name)"
    else:
        by = (f"another job: pid {who.get('pid')} on {who.get('host')}, started {who.get('started')}, running "
              f"`{who.get('command')}`")
    return (f"run directory {root} is in use by {by}; wait for it to finish or stop it, or pass another "
            "--config.output_dir")
