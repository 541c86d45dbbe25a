"""Training checkpoints: the one orbax CheckpointManager every resumable loop of kvjax uses (residual training, LM
pretraining, the block drafter's training).

Saves stay asynchronous (the arrays are written in the background while the next steps run), but a step's
temporary directories are created synchronously, before the save returns: a barrier, then process 0 makes them.
With orbax 0.12's default, asynchronous directory creation, the step directory (`12.orbax-checkpoint-tmp`) and the
item directory inside it (`.../default.orbax-checkpoint-tmp`) are made by two background threads that coordinate
through signals in JAX's coordination service; on a slow CI machine process 0 failed there with FileExistsError on
the item directory and process 1 waited 600 s for a directory that never appeared (the two-process job of
tests/test_multihost.py). It would not reproduce on demand. The synchronous path, orbax's own when checkpointing is
not asynchronous, makes both directories in order on the calling thread: a barrier and two mkdirs per save."""

from __future__ import annotations

import os

import orbax.checkpoint as ocp


def manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
    """A CheckpointManager over `directory` (created if missing) keeping the last `max_to_keep` steps. In a
    multi-process run every process calls this with the same directory, on a filesystem they share."""
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))
