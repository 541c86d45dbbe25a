"""The map only: ridge + residual fitted on a token file, no evaluations.

    python -m kvjax.launch --config=fit --config.source.path=SRC --config.target.path=TGT \
        --config.data.train_text=tokens.npy --config.output_dir=runs/map
    # N processes: every one runs the same command (launch/cluster/multihost.py locally, its templates/ on clusters)

The run directory gets map_ridge/ and map/ (kvjax.save_map, written by process 0), residual/ (orbax checkpoints
written by every process: put it on a filesystem every host sees) and a report with the map's fit only. The
held-out windows the calibrate stage cuts are unused (no evaluation); they come from the same token file.
"""

import dataclasses

from kvjax.eval.gate import GateConfig
from kvjax.fitting.residual_config import ResidualConfig
from kvjax.run.config import DataConfig, EvalConfig, MapConfig, ModelConfig, RunConfig


def no_evaluations() -> EvalConfig:
    """Every evaluation of the registry switched off (whichever it holds)."""
    ev = EvalConfig()
    return dataclasses.replace(ev, **{f.name: dataclasses.replace(getattr(ev, f.name), enabled=False)
                                      for f in dataclasses.fields(ev) if hasattr(getattr(ev, f.name), "enabled")})


def get_config() -> RunConfig:
    return RunConfig(
        name="fit",
        source=ModelConfig(env="KVJAX_SOURCE"),
        target=ModelConfig(env="KVJAX_TARGET"),
        output_dir="runs/fit",
        data=DataConfig(train_text=("stdlib:train",), heldout_text=("stdlib:heldout",), heldout_window_len=512),
        map=MapConfig(calib_windows=256, select_windows=32, window_len=512, batch_size=8, pairing="depth",
                      residual_rank=16),
        residual=ResidualConfig(steps=200, batch_size=8, prefix_len=256, cont_len=64, lr=1e-3, warmup_steps=20,
                                save_every=50),
        eval=no_evaluations(),
        # nothing is measured, so nothing is gated (a gate with thresholds and no measurements fails)
        gate=GateConfig(min_key_cos=None, min_value_cos=None, max_kl_vs_target=None, min_kl_reduction=None,
                        min_mc_retention=None, max_kl=None),
    )
