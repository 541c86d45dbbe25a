"""The main job's command line as the former standalone pipelines used it (their shims are gone: these are the
`python -m kvjax.launch` arguments they forwarded): the map-only `fit` config with the distributed flags, and the
toy config with its evaluations selected by flags; and the distributed flags checked before anything runs."""

import os

import numpy as np
import pytest

from kvjax.job import command as launch

from kvjax.job.stages import plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "checkpoints", "toy")


def test_fit_config_with_distributed_flags(tmp_path):
    np.save(tmp_path / "tokens.npy", np.random.RandomState(0).randint(1, 8000, 5000).astype(np.uint16))
    tokens, run = str(tmp_path / "tokens.npy"), str(tmp_path / "run")
    argv = ["--config=fit", f"--config.source.path={TOY}/source", f"--config.target.path={TOY}/target",
            f"--config.data.train_text={tokens}", f"--config.data.heldout_text={tokens}",
            "--config.data.max_train_tokens=5000", f"--config.output_dir={run}", "--config.map.pairing=top3",
            "--config.map.window_len=64", "--config.data.heldout_window_len=64", "--config.map.select_windows=4",
            "--config.residual.steps=7", "--config.residual.seed=5", "--config.seed=5", "--config.mesh.data=2",
            "--config.mesh.model=1", "--distributed=off", "--step_timeout=600"]
    from kvjax.config_flags import split_launch_flags
    flags, rest = split_launch_flags(argv)
    assert flags.distributed == "off" and flags.step_timeout == 600.0
    cfg, redo, _ = launch.parse(rest)
    assert cfg.name == "fit" and cfg.output_dir == run and redo == ()
    assert cfg.data.train_text == (tokens,) and cfg.data.max_train_tokens == 5000
    assert (cfg.map.pairing, cfg.map.window_len, cfg.map.select_windows) == ("top3", 64, 4)
    assert (cfg.residual.steps, cfg.residual.seed, cfg.seed) == (7, 5, 5)
    assert (cfg.mesh.data, cfg.mesh.model) == (2, 1)
    assert list(plan(cfg)) == ["calibrate", "ridge", "residual", "report"]  # the map only


def test_toy_config_with_evaluations_selected_by_flags():
    argv = ["--config=toy", f"--config.target.path={TOY}/pruned", "--config.map.pairing=top3",
            "--config.residual.lr=3e-3", "--config.residual.rollout=true", "--config.output_dir=runs/x",
            "--config.eval.mc.limit=50", "--config.eval.throughput.enabled=false",
            "--config.eval.distances.windows=32", "--config.eval.kl.windows=128"]
    cfg, _, _ = launch.parse(argv)
    assert cfg.name == "toy" and cfg.target.path == f"{TOY}/pruned" and cfg.output_dir == "runs/x"
    assert cfg.map.pairing == "top3" and cfg.residual.lr == 3e-3 and cfg.residual.rollout
    assert cfg.eval.mc.enabled and cfg.eval.mc.limit == 50 and not cfg.eval.throughput.enabled
    assert (cfg.eval.distances.windows, cfg.eval.kl.windows) == (32, 128)  # held-out rows 0:32 and 32:160
    assert "throughput" not in plan(cfg) and {"mc", "kl", "distances"} <= set(plan(cfg))
    from kvjax.run.preflight import LaunchError
    with pytest.raises(LaunchError, match="map.pairing='best'"):
        launch.parse(["--config=toy", "--config.map.pairing=best"])


def test_distributed_flags_are_checked_before_anything_runs(tmp_path, capsys, monkeypatch):
    from kvjax.distributed import ENV_ADDRESS, ENV_ID, ENV_NUM
    from kvjax.config_flags import split_launch_flags
    for name in (ENV_ADDRESS, ENV_NUM, ENV_ID):
        monkeypatch.delenv(name, raising=False)
    flags, rest = split_launch_flags(["--config=toy", "--num-processes=4", "--process_id=1", "--redo=report",
                                      "--coordinator=10.0.0.1:1234"])
    assert (flags.num_processes, flags.process_id, flags.coordinator) == (4, 1, "10.0.0.1:1234")
    assert rest == ["--config=toy", "--redo=report"]
    out = tmp_path / "run"
    for bad, message in (("--distributed=maybe", "--distributed=maybe: use auto, on or off"),
                         ("--step_timeout=soon", "--step_timeout='soon': expected float"),
                         ("--coordinator", "--coordinator: give a value"),
                         ("--num_processes=2", "2 processes but no coordinator address")):
        assert launch.main([f"--config.output_dir={out}", bad]) == 2, bad
        assert message in capsys.readouterr().err, bad
    assert not out.exists()
