"""Training checkpoints: the one orbax CheckpointManager every resumable loop of kvjax uses (residual training, LM
pretraining, the block drafter's training).

Saves stay asynchronous (the arrays are written in the background while the next steps run), but the step's
temporary directories are created synchronously, before the save returns. orbax 0.12's asynchronous directory
creation makes the step directory (`12.orbax-checkpoint-tmp`) and the item directory inside it
(`12.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp`) in two unordered background tasks; on a slow machine they
race (FileExistsError on process 0), and in a multi-process run the other processes then wait 600 s for a directory
that never appears. Creating them synchronously costs a barrier and two mkdirs per save."""

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
