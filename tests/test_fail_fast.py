"""Fail fast: `python -m kvjax.launch` and `python -m kvjax.serve` report a bad flag, an unknown config field and a
missing or broken checkpoint with a message naming the fix, exit non-zero, print no traceback and write nothing,
all before importing JAX (checked on the real entry points with `python -X importtime`, and on the check functions
in a fresh interpreter). No timing asserts: launch/bench/fail_fast.py measures the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "checkpoints", "toy")
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def cli(module: str, *args: str, env: dict | None = None) -> tuple[int, str, set[str]]:
    """(exit code, stderr without -X importtime's lines, top-level packages the process imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})
    lines = proc.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines if line.startswith("import time:")}
    return proc.returncode, "\n".join(line for line in lines if not line.startswith("import time:")), imported


def in_fresh_python(code: str) -> dict:
    """Run `code` (which sets `result`) in a new interpreter; returns result plus the heavy modules it imported."""
    wrapped = (f"import json, sys\n{code}\n"
               f"result['heavy'] = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
               "print(json.dumps(result))")
    proc = subprocess.run([sys.executable, "-c", wrapped], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = [  # (arguments, what the message must say)
    (["--bogus"], ["--bogus"]),
    (["--config.eval.mc.limt=3"], ["unknown config field 'eval.mc.limt'", "did you mean 'eval.mc.limit'"]),
    (["--config.source.path=/nonexistent/ckpt"], ["source checkpoint directory '/nonexistent/ckpt' does not exist",
                                                  "--config.source.path"]),
]


@pytest.mark.parametrize("module", ["kvjax.launch", "kvjax.serve"])
@pytest.mark.parametrize("args, words", CASES, ids=["bad flag", "unknown field", "missing checkpoint"])
def test_mistakes_are_reported_before_jax_is_imported(module, args, words, tmp_path):
    out = tmp_path / "run"
    rc, err, imported = cli(module, *args, f"--config.output_dir={out}")
    assert rc == 2, err
    assert err.startswith(f"{module}: error: ") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not imported & set(HEAVY), f"{module} imported {imported & set(HEAVY)} before reporting: {err}"
    assert not out.exists()


def test_a_broken_checkpoint_is_reported_from_its_header_before_jax(tmp_path):
    """A directory that is no checkpoint: no config.json, no weights (launch: with the data checks; serve too)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    for module in ("kvjax.launch", "kvjax.serve"):
        rc, err, imported = cli(module, f"--config.source.path={empty}", f"--config.output_dir={tmp_path / 'run'}")
        assert rc == 2 and "Traceback" not in err, err
        assert f"{empty} has no config.json" in err and "kvjax reads only safetensors" in err, err
        assert not imported & set(HEAVY), imported & set(HEAVY)
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_corpus_is_reported_before_jax_and_datasets(tmp_path):
    """The real configs stream their text from the hub: offline, and without a cached or local copy, the command
    says so from the fast checks, importing neither JAX nor `datasets` (whose import alone takes about a second)."""
    out = tmp_path / "run"
    rc, err, imported = cli("kvjax.launch", "--config=qwen32_8", f"--config.output_dir={out}",
                            env={"HF_HUB_OFFLINE": "1", "KVJAX_SOURCE": os.path.join(TOY, "source"),
                                 "KVJAX_TARGET": os.path.join(TOY, "pruned")})
    assert rc == 2 and "Traceback" not in err, err
    assert "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train (data.train_text and data.heldout_text)" in err, err
    assert not imported & {*HEAVY, "datasets", "huggingface_hub"}, imported & {*HEAVY, "datasets", "huggingface_hub"}
    assert not out.exists()


def test_the_command_lines_check_functions_import_no_jax(tmp_path):
    """The checks themselves, called as the commands call them, in a fresh interpreter: the error is raised with JAX
    never imported, and a good config passes them likewise."""
    result = in_fresh_python(
        "from kvjax.job import command as launch\nfrom kvjax.serve import cli\nresult = {}\n"
        "for name, argv in [('flag', ['--bogus']), ('field', ['--config.nope=1']),\n"
        "                   ('ckpt', ['--config.target.path=/nonexistent/t'])]:\n"
        "    for who, fn in [('launch', launch.read), ('serve', cli.parse)]:\n"
        "        try:\n"
        "            fn(argv)\n"
        "            result[f'{who} {name}'] = None\n"
        "        except BaseException as e:\n"
        "            result[f'{who} {name}'] = f'{type(e).__name__}: {e}'\n"
        f"cfg, redo = launch.read(['--config.output_dir={tmp_path / 'run'}', '--redo=mc'])\n"
        "result['good'] = [cfg.name, list(redo)]\n")
    assert result["heavy"] == []
    assert result["good"] == ["toy_pruned_quick", ["mc"]]
    assert result["launch flag"].startswith("LaunchError: unknown argument '--bogus'")
    assert result["serve flag"].startswith("ServeError: unrecognized arguments: --bogus")
    for who in ("launch", "serve"):
        assert result[f"{who} field"].startswith("ConfigFlagError: unknown config field 'nope'")
        assert "target checkpoint directory '/nonexistent/t' does not exist" in result[f"{who} ckpt"]
    assert not (tmp_path / "run").exists()


def test_every_shipped_config_loads_without_jax():
    result = in_fresh_python(
        "import os\nos.environ.setdefault('KVJAX_SOURCE', ''); os.environ.setdefault('KVJAX_TARGET', '')\n"
        "from kvjax import config_flags\nfrom kvjax.run.config import RunConfig\n"
        "result = {'names': [config_flags.build(n, [], RunConfig).name for n in config_flags.available_configs()]}\n")
    assert result["heavy"] == [] and "toy" in result["names"]


def test_the_packages_load_their_names_on_first_use():
    """`import kvjax` (and kvjax.eval, kvjax.serve) imports no JAX; every public name still resolves, submodules
    too (`kvjax.hf` after a bare `import kvjax`)."""
    assert in_fresh_python("import kvjax, kvjax.eval, kvjax.serve\nresult = {}\n")["heavy"] == []
    import kvjax
    import kvjax.eval
    import kvjax.serve
    for package in (kvjax, kvjax.eval, kvjax.serve):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
    assert kvjax.hf.load_tokenizer is kvjax.load_tokenizer and kvjax.serve.Engine.__name__ == "Engine"
    with pytest.raises(AttributeError):
        kvjax.no_such_name  # noqa: B018


# ---- the header checks ----------------------------------------------------------------------------------------------

def test_checkpoint_header_problems(tmp_path):
    from kvjax.run.preflight import checkpoint_problems
    assert checkpoint_problems(os.path.join(TOY, "source")) == []
    assert "does not exist" in checkpoint_problems(str(tmp_path / "nope"))[0]
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"")
    assert checkpoint_problems(str(ck)) == [f"{ck} has no config.json; an HF checkpoint directory needs config.json "
                                            "next to its .safetensors files"]
    (ck / "config.json").write_text("{not json")
    assert "config.json is not readable JSON" in checkpoint_problems(str(ck))[0]
    (ck / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert checkpoint_problems(str(ck)) == [f"{ck / 'config.json'}: model_type 'gpt2' is not supported; kvjax reads "
                                            "checkpoints of model_type 'qwen3', 'qwen3_moe', 'llama'"]
    (ck / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_problems(str(ck)) == []
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors",
                                                                                "b": "model-00002.safetensors"}}))
    (ck / "model-00001.safetensors").write_bytes(b"")
    assert "names shard 'model-00002.safetensors'" in checkpoint_problems(str(ck))[0]
    os.remove(ck / "model.safetensors.index.json")
    os.remove(ck / "model.safetensors")
    assert "neither model.safetensors nor model.safetensors.index.json" in checkpoint_problems(str(ck))[0]


def test_known_model_types_are_the_registered_families():
    """The header check reads the families' model_types from their source (importing them imports JAX); it must
    name exactly what the registry holds."""
    from kvjax.models import family
    from kvjax.run.preflight import known_model_types
    assert sorted(known_model_types()) == sorted(family._BY_MODEL_TYPE)


def test_a_checkpoint_the_loader_refuses_is_refused_by_the_header_check_too(tmp_path):
    """Every header problem the fast check reports, the loader (kvjax.hf) reports as well: the fast check adds no
    rule of its own."""
    from kvjax.hf import CheckpointError, load_hf_config
    from kvjax.models.config import ConfigError
    from kvjax.run.preflight import checkpoint_problems
    for header in ({"model_type": "gpt2"}, None):
        ck = tmp_path / f"ck_{header is None}"
        ck.mkdir()
        if header is not None:
            (ck / "config.json").write_text(json.dumps(header))
        assert checkpoint_problems(str(ck))
        with pytest.raises((CheckpointError, ConfigError)):
            load_hf_config(str(ck))


# ---- one table of map directories -----------------------------------------------------------------------------------

def test_map_directories_come_from_one_table(tmp_path):
    from kvjax import config_flags
    from kvjax.mapper.artifact import MANIFEST
    from kvjax.run.config import RunConfig
    from kvjax.serve import cli
    from kvjax.run.layout import MAP_DIRS, final_arm
    from kvjax.job.stages import plan
    assert cli.MANIFEST == MANIFEST
    cfg = config_flags.build("toy", [("output_dir", str(tmp_path)), ("peers.perhead_topk", "2"),
                                     ("peers.bridge_topk", "1")], RunConfig)
    stages = plan(cfg)
    for arm, where in MAP_DIRS.items():
        assert stages[arm].outputs[0] == where
    assert cli.final_map_dir(cfg) == os.path.join(str(tmp_path), MAP_DIRS[final_arm(cfg)])


def test_stage_hashes_are_those_of_earlier_runs(monkeypatch):
    """A rerun reuses the stages an earlier version of kvjax finished: the hashes of the toy config's map stages
    (with a fixed checkpoint identity) are the ones they have been since before the job was split into
    kvjax.job. If you change what a stage depends on on purpose, every earlier run directory recomputes that
    stage: update these values and say so."""
    from kvjax import config_flags
    from kvjax.run.config import RunConfig
    from kvjax.job import stages as plan_module
    monkeypatch.setattr(plan_module, "model_identity", lambda path: {
        "config.json": f"cfg-{os.path.basename(path)}", "tokenizer.json": "tok", "model.safetensors": [1, 2]})
    monkeypatch.chdir(REPO)
    cfg = config_flags.build("toy", [("output_dir", "runs/golden"), ("peers.perhead_topk", "2")], RunConfig)
    hashes = {k: s.hash for k, s in plan_module.plan(cfg).items()}
    assert {k: hashes[k] for k in ("calibrate", "ridge", "residual", "perhead")} == {
        "calibrate": "5ad6fca926a7e6a3", "ridge": "20a42c7deac51424", "residual": "db7844912a7f8a41",
        "perhead": "e621079a7dd8b212"}
