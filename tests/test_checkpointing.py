"""kvjax.checkpointing: the one CheckpointManager of the training loops (residual, pretraining, block drafter).

Its reason to exist is a race in orbax's asynchronous directory creation that failed CI on a slow machine (a
FileExistsError on process 0 of the two-process job, then a 600 s wait on process 1); the race itself does not
reproduce on demand, so these tests pin down the two things that remove it: the manager creates a step's directories
synchronously, and no training loop builds a manager of its own."""

import pathlib

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kvjax import checkpointing

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_saves_asynchronously_with_directories_made_before_save_returns(tmp_path):
    manager = checkpointing.manager(str(tmp_path / "ckpt"), max_to_keep=2)
    assert manager._options.async_options.create_directories_asynchronously is False  # noqa: SLF001
    assert manager._options.enable_async_checkpointing  # the arrays are still written in the background
    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(0)}
    for step in (3, 6, 9):
        manager.save(step, args=ocp.args.StandardSave({**state, "step": jnp.asarray(step)}))
    manager.wait_until_finished()
    assert manager.all_steps() == [6, 9]  # max_to_keep
    restored = manager.restore(9, args=ocp.args.StandardRestore(state))
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert int(restored["step"]) == 9
    manager.close()


def test_no_training_loop_builds_its_own_manager():
    """A loop with `ocp.CheckpointManager(...)` of its own would bring the asynchronous directory creation back."""
    own = [str(p.relative_to(REPO)) for p in sorted((REPO / "kvjax").rglob("*.py"))
           if p.name != "checkpointing.py" and "CheckpointManager(" in p.read_text()]
    assert own == [], f"use kvjax.checkpointing.manager instead of ocp.CheckpointManager in {own}"
