"""kvjax.plan: programs compiled ahead of time for TPU slices (libtpu, no TPU), the fit check, and the plan against
what a real run of the same config calls and holds."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from kvjax import aot
from kvjax.config_flags import build, parse_argv
from kvjax.models.config import load_config
from kvjax.models.decoder import decode_jit
from kvjax.plan import hardware, shapes
from kvjax.plan.hardware import PlanError
from kvjax.run.config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, "configs", "models")


def tpu_or_skip():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        pytest.skip("libtpu is not installed (the test extra brings it: pip install -e '.[test]')")
    hardware.compile_only_environment()


@pytest.fixture(scope="module", autouse=True)
def in_repo_root():
    """The shipped configs name repository-relative paths (configs/models/...)."""
    old = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(old)


def test_a_tpu_decode_holds_its_sharded_weights_and_cache():
    """Qwen3-8B's shapes (two of its layers: the per-layer arrays are the model's own) compiled for a v5e 2x4 slice:
    per chip, XLA's argument bytes are the weights' and the cache's shards, to 1%."""
    tpu_or_skip()
    cfg = dataclasses.replace(load_config(os.path.join(MODELS, "Qwen3-8B", "config.json")), num_layers=2)
    sl = hardware.get_slice("v5e:2x4")
    assert len(sl.devices) == 8 and sl.hbm_bytes == 16e9 and sl.devices[0].platform == "tpu"
    from kvjax import sharding
    mesh = sharding.make_mesh(1, 8, list(sl.devices))
    model = shapes.model(cfg, jnp.bfloat16, mesh)
    cache = shapes.cache(cfg, 1, 4096, jnp.bfloat16, mesh)
    tokens = shapes.replicated((1,), jnp.int32, mesh)
    with jax.set_mesh(mesh):
        compiled = decode_jit.lower(model.params, cfg, tokens, cache).compile()
    want = shapes.nbytes_per_device(model.params) + shapes.nbytes_per_device(cache) + 4
    got = compiled.memory_analysis().argument_size_in_bytes
    assert abs(got - want) / want < 0.01, (got, want)
    # the cache is donated: written in place, not held twice
    assert compiled.memory_analysis().alias_size_in_bytes >= shapes.nbytes_per_device(cache.keys) * 2 * 0.99


def test_a_config_over_hbm_is_refused_naming_its_stage_and_program():
    """Qwen3-32B + Qwen3-8B (82 GB of bf16 weights) on four 16 GB v5e chips: every stage is over, and the check
    names the stage, its largest program, the GB over and what to change."""
    tpu_or_skip()
    from kvjax.plan.check import job_problems
    name, overrides, _ = parse_argv(["--config=qwen32_8"])
    cfg = build(name, overrides, RunConfig)
    sl = hardware.get_slice("v5e:2x2")
    problems = job_problems(cfg, sl.devices, sl.hbm_bytes)
    ridge = next(p for p in problems if p.startswith("stage ridge"))
    assert "ridge statistics 4 x 1024" in ridge and "GB over" in ridge and "larger slice" in ridge
    assert any(p.startswith("stage retrieval") for p in problems)
    # on 8 v6e chips (32 GB each) the weights fit: the ridge stage passes the check
    sl = hardware.get_slice("v6e:2x4")
    assert not any(p.startswith("stage ridge") for p in job_problems(cfg, sl.devices, sl.hbm_bytes))


def test_topologies_are_checked_with_a_clear_error():
    with pytest.raises(PlanError, match="use GEN:SHAPE"):
        hardware.parse("v7:2x4")
    with pytest.raises(PlanError, match="3 dimensions"):
        hardware.parse("v5p:2x4")
    assert hardware.ladder("v5e")[:3] == ("v5e:1x1", "v5e:2x2", "v5e:2x4")


def test_the_command_refuses_bad_flags_in_one_line():
    for args, needle in ((["--config=qwen32_8"], "--topology=SLICE is required"),
                         (["--config=qwen32_8", "--topology=v9:2x2"], "use GEN:SHAPE"),
                         (["--config=qwen32_8", "--topology=v5e:2x4", "--depth=half"], "use full or sampled"),
                         (["--topology=v5e:2x4"], "--config=NAME is required"),
                         (["--config=qwen32_8", "--topology=v5e:2x4", "--serve", "--speculative=fast"],
                          "use one of none, lookup"),
                         (["--config=qwen32_8", "--topology=v5e:2x4", "--serve", "--speculative=block"],
                          "pass its directory with --drafter DIR"),
                         (["--config=qwen32_8", "--topology=v5e:2x4", "--speculative=lookup"], "add --serve")):
        r = subprocess.run([sys.executable, "-m", "kvjax.plan", *args], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_an_evaluation_without_a_plan_stops_the_plan():
    from kvjax.plan import evals
    with pytest.raises(PlanError, match="no entry for evaluation 'nonesuch'"):
        evals.programs("nonesuch", None, None, {}, "residual")


# ---- the plan against a real run -------------------------------------------------------------------------------

RUN = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
from kvjax import aot, launch
argv = json.loads(sys.argv[1])
with aot.recording(memory=True) as rec:
    rc = launch.main(argv)
json.dump({"rc": rc, "calls": sorted({f"{s}|{n}" for (s, n) in rec.calls}), "live": rec.live},
          open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """The qwen32_8 job with tiny checkpoints on one CPU device, every program call recorded with the bytes held."""
    import kvjax
    from test_launch import SMALL, TOKENIZER, write_mc_sets
    root = tmp_path_factory.mktemp("plan_run")

    def make(name, hidden, layers, heads, kv, hd, seed):
        cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                                num_heads=heads, num_kv_heads=kv, head_dim=hd, rope_theta=10_000.0,
                                tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
        path = str(root / name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        return path

    env = {"KVJAX_SOURCE": make("source", 128, 3, 4, 2, 32, 0), "KVJAX_TARGET": make("target", 64, 2, 2, 1, 32, 1)}
    argv = ["--config=qwen32_8", f"--config.output_dir={root / 'run'}", "--config.source.dtype=float32",
            "--config.target.dtype=float32", "--config.data.train_text=stdlib:train",
            "--config.data.heldout_text=stdlib:heldout", *SMALL, *write_mc_sets(str(root))]
    out = root / "record.json"
    r = subprocess.run([sys.executable, "-c", RUN, json.dumps(argv), str(out)], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, **env, "JAX_PLATFORMS": "cpu"}, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["rc"] == 0
    return argv, env, record


@pytest.mark.slow
def test_the_plan_holds_every_program_a_run_calls_and_what_it_holds(recorded_run, monkeypatch):
    """Planned for one CPU device, the same config names, stage by stage, exactly the programs the run called
    (kvjax.aot recorded them), and per stage the run's live bytes lie between the weights the plan holds and its
    compiled peak (5% for the small arrays the plan does not model)."""
    argv, env, record = recorded_run
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from kvjax.plan import plan_job
    name, overrides, _ = parse_argv(argv)
    plan = plan_job(build(name, overrides, RunConfig), "cpu:1")
    called: dict[str, set] = {}
    for entry in record["calls"]:
        stage, program = entry.split("|")
        called.setdefault(stage, set()).add(program)
    planned = {s.name: {c.program.program for c in s.programs} for s in plan.stages}
    for stage in called:
        assert called[stage] == planned.get(stage, set()), (stage, called[stage] ^ planned.get(stage, set()))
    assert set(called) == {s for s, p in planned.items() if p}
    for s in plan.stages:
        if not s.programs:
            continue
        live = record["live"][s.name]
        assert not s.errors
        assert s.held_bytes <= live <= 1.05 * s.peak_bytes, (s.name, s.held_bytes, live, s.peak_bytes)


def test_the_job_refuses_a_config_its_devices_cannot_hold_before_reading_weights(tmp_path):
    """--config.mesh.device_memory_gb below the weights: the job exits 2 within a minute, naming the stage and the
    program over, and never loads a model."""
    from test_launch import tiny_pair, write_mc_sets
    source, target = tiny_pair(str(tmp_path))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=qwen32_8",
                        f"--config.output_dir={tmp_path / 'run'}", "--config.data.train_text=stdlib:train",
                        "--config.data.heldout_text=stdlib:heldout", "--config.mesh.device_memory_gb=0.0001",
                        *write_mc_sets(str(tmp_path))],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVJAX_SOURCE": source, "KVJAX_TARGET": target, "JAX_PLATFORMS": "cpu"})
    elapsed = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr[-2000:]
    assert "does not fit these devices" in r.stderr and "stage ridge: ridge statistics" in r.stderr
    assert "Traceback" not in r.stderr and "loaded source" not in r.stderr
    assert not os.path.exists(tmp_path / "run" / "stages")
    assert elapsed < 60, elapsed


def test_the_stages_by_name_are_the_jobs_plan():
    """kvjax.run.layout (what the plan and the space estimate read, without models) lists the job's stages."""
    from kvjax.run.layout import stage_names
    from kvjax.job.stages import plan
    for name in ("toy_pruned_quick", "toy_reverse", "toy_audio"):
        n, overrides, _ = parse_argv([f"--config={name}"])
        cfg = build(n, overrides, RunConfig)
        assert stage_names(cfg) == tuple(plan(cfg)), name


def test_a_stopped_plan_resumes_from_the_programs_it_kept(tmp_path, monkeypatch):
    """compile_all keeps each compiled program's result in the store and a second plan reads it back instead of
    compiling; a change to kvjax's source (the store's code version) compiles again."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kvjax import plan as kvplan
    from kvjax.plan import program, store
    from kvjax.sharding import make_mesh
    mesh = make_mesh(1, 1, jax.devices()[:1])
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    square = aot.jit(lambda a: a @ a.T)
    stages = lambda: {"s": [program.Program("s", "gram 64 x 32", square, (x,), {}, mesh, 2 * 64 * 64 * 32, 0)]}  # noqa: E731
    first = kvplan.compile_all(stages(), {}, store=str(tmp_path))[0].programs[0]
    assert first.compiled and first.output_bytes == 64 * 64 * 4 and len(list(tmp_path.glob("*.json"))) == 1

    def refuse(*a, **k):
        raise AssertionError("compiled again")
    monkeypatch.setattr(program, "compile_program", refuse)
    again = kvplan.compile_all(stages(), {}, store=str(tmp_path))[0].programs[0]
    assert again.compiled and (again.output_bytes, again.compile_seconds) == (first.output_bytes, first.compile_seconds)
    monkeypatch.setattr(store, "code_version", lambda: "edited")
    with pytest.raises(AssertionError, match="compiled again"):
        kvplan.compile_all(stages(), {}, store=str(tmp_path))


@pytest.fixture(scope="module")
def deeper_pair(tmp_path_factory):
    """Tiny checkpoints deep enough for --depth=sampled's three depths to differ (5 and 4 layers)."""
    import kvjax
    root = tmp_path_factory.mktemp("deeper")

    def make(name, layers, seed):
        cfg = kvjax.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
                                num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=True,
                                eos_token_ids=(0,), pad_token_id=0)
        path = str(root / name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1))
        return path

    return [("source.path", make("source", 5, 0)), ("target.path", make("target", 4, 1)),
            ("source.dtype", "float32"), ("target.dtype", "float32")]


def test_sampled_depths_and_peaks_agree_with_the_full_plan(deeper_pair):
    """--depth=sampled: each program's arguments and outputs extrapolated from three shallow compiles equal the
    full-depth compile's within 1%, its temporaries never below; --compile=peaks: each stage's peak is the full
    plan's, from its largest programs alone."""
    from kvjax.plan import plan_job
    cfg = build("qwen32_8", deeper_pair, RunConfig)
    full = plan_job(cfg, "cpu:1", only=("kl",))
    sampled = plan_job(cfg, "cpu:1", only=("kl",), sampled=True)
    peaks = plan_job(cfg, "cpu:1", only=("kl",), peaks=2)
    both = plan_job(cfg, "cpu:1", only=("kl",), sampled=True, peaks=2)
    for f, s, p, b in zip(full.stages, sampled.stages, peaks.stages, both.stages):
        assert f.programs and not (f.errors or s.errors or p.errors or b.errors)
        for cf, cs in zip(f.programs, s.programs):
            for field in ("argument_bytes", "output_bytes"):
                assert getattr(cs, field) == pytest.approx(getattr(cf, field), rel=0.01), (cf.program.name, field)
            assert cs.temp_bytes >= 0.99 * cf.temp_bytes, cf.program.name
        assert p.peak_bytes == f.peak_bytes and sum(c.compiled for c in p.programs) <= 4 < len(f.programs)
        assert b.peak_bytes >= 0.99 * f.peak_bytes and sum(c.compiled for c in b.programs) <= 4
