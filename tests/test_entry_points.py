"""The former standalone pipelines are flags over the main job: launch.cluster.fit_distributed and launch.toy.fit_map
translate into `python -m kvjax.launch` arguments that it accepts (checked by its own parser and preflight), with
the settings they used to stand for."""

import os

import numpy as np
import pytest

from kvjax import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "checkpoints", "toy")


def test_fit_distributed_is_the_fit_config(tmp_path):
    from launch.cluster import fit_distributed
    np.save(tmp_path / "tokens.npy", np.random.RandomState(0).randint(1, 8000, 5000).astype(np.uint16))
    args = fit_distributed.parse_args([
        "--source", f"{TOY}/source", "--target", f"{TOY}/target", "--tokens", str(tmp_path / "tokens.npy"),
        "--out", str(tmp_path / "run"), "--pairing", "3", "--window", "64", "--heldout-windows", "4",
        "--residual-steps", "7", "--mesh-data", "2", "--mesh-model", "1", "--seed", "5", "--distributed", "off",
        "--step-timeout", "600"])
    argv = fit_distributed.launch_args(args)
    assert "--distributed=off" in argv and "--step_timeout=600.0" in argv
    from kvjax.distributed import split_launch_flags
    flags, rest = split_launch_flags(argv)
    assert flags.distributed == "off" and flags.step_timeout == 600.0
    cfg, redo, _ = launch.parse(rest)
    assert cfg.name == "fit" and cfg.output_dir == str(tmp_path / "run") and redo == ()
    assert cfg.data.train_text == (str(tmp_path / "tokens.npy"),) and cfg.data.max_train_tokens == 5000
    assert (cfg.map.pairing, cfg.map.window_len, cfg.map.select_windows) == ("top3", 64, 4)
    assert (cfg.residual.steps, cfg.residual.seed, cfg.seed) == (7, 5, 5)
    assert (cfg.mesh.data, cfg.mesh.model) == (2, 1)
    assert list(launch.plan(cfg)) == ["calibrate", "ridge", "residual", "report"]  # the map only


def test_toy_fit_map_is_the_toy_config():
    from launch.toy import fit_map
    argv = fit_map.launch_args(fit_map.parse_args(["--target", f"{TOY}/pruned", "--pairing", "3", "--mc", "50",
                                                   "--residual-lr", "3e-3", "--rollout", "--out", "runs/x"]))
    cfg, _, _ = launch.parse(argv)
    assert cfg.name == "toy" and cfg.target.path == f"{TOY}/pruned" and cfg.output_dir == "runs/x"
    assert cfg.map.pairing == "top3" and cfg.residual.lr == 3e-3 and cfg.residual.rollout
    assert cfg.eval.mc.enabled and cfg.eval.mc.limit == 50 and not cfg.eval.throughput.enabled
    assert (cfg.eval.distances.windows, cfg.eval.kl.windows) == (32, 128)  # held-out rows 0:32 and 32:160
    with pytest.raises(SystemExit, match="--pairing 'best'"):
        fit_map.launch_args(fit_map.parse_args(["--pairing", "best"]))


def test_distributed_flags_are_checked_before_anything_runs(tmp_path, capsys, monkeypatch):
    from kvjax.distributed import ENV_ADDRESS, ENV_ID, ENV_NUM, split_launch_flags
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
