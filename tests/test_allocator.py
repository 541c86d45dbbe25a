"""kvjax.allocator: the host allocator settings of kvjax's programs, checked in fresh processes (the test process
itself keeps the C library's defaults, tests/conftest.py)."""

import glob
import os
import subprocess
import sys

import pytest

PROBE = ("from kvjax import allocator; print(allocator.tune()); print(allocator.tune())")


def run(env_value):
    env = {**os.environ}
    env.pop("KVJAX_MALLOC", None)
    env.pop("LD_PRELOAD", None)
    if env_value is not None:
        env["KVJAX_MALLOC"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the settings are glibc's")
def test_tuned_by_default_and_once():
    out = run(None)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == second  # applied once, the same answer after
    if "not glibc" not in first:  # musl and other C libraries keep their defaults
        assert first.startswith("glibc ") and "one arena, no mmap'd blocks, no trimming" in first


def test_system_leaves_the_defaults():
    out = run("system")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "system allocator defaults (KVJAX_MALLOC=system)"


def test_unknown_value_names_the_choices():
    out = run("fast")
    assert out.returncode != 0
    assert "KVJAX_MALLOC='fast': use 'tuned' (the default) or 'system'" in out.stderr


def test_tuned_decode_matches_system():
    """The settings change where memory comes from, never a result: one decode step, both ways, same logits."""
    code = ("import numpy as np, jax, jax.numpy as jnp; from kvjax import allocator; allocator.tune();"
            "import kvjax; from kvjax.models.config import Qwen3Config;"
            "cfg = Qwen3Config.from_hf_dict(dict(model_type='qwen3', vocab_size=64, hidden_size=32,"
            " intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8));"
            "p = kvjax.init_params(cfg, jax.random.PRNGKey(0)); c = kvjax.init_cache(cfg, 2, 64);"
            "_, c = kvjax.prefill(p, cfg, jnp.ones((2, 5), jnp.int32), c);"
            "l, c = kvjax.decode_step(p, cfg, jnp.array([3, 4], jnp.int32), c); print(np.asarray(l).tobytes().hex())")
    outs = []
    for value, pages in (("tuned", "1"), ("tuned", "0"), ("system", "0")):
        env = {**os.environ, "KVJAX_MALLOC": value, "JAX_PLATFORMS": "cpu",
               "GLIBC_TUNABLES": f"glibc.malloc.hugetlb={pages}"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1] == outs[2]


def test_environ_adds_huge_pages_where_they_help(monkeypatch):
    from kvjax import allocator
    monkeypatch.setattr(allocator, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    assert allocator.environ({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    other = allocator.environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert other == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}
    # the user's own choice either way, and the C library's defaults, are left as they are
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert allocator.environ(off) == off
    assert allocator.environ({"KVJAX_MALLOC": "system"}) == {"KVJAX_MALLOC": "system"}
    for mode in ("always", "never", None):  # the kernel gives huge pages without asking, or never
        monkeypatch.setattr(allocator, "thp_mode", lambda: mode)
        assert allocator.environ({}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the settings are glibc's")
def test_reexec_restarts_once_under_huge_pages():
    """A program's entry calls reexec() first: it restarts under allocator.environ() once (no output twice), and
    tune() then reports the huge pages."""
    from kvjax import allocator
    code = ("from kvjax import allocator; allocator.reexec(); import os; print(os.environ.get('GLIBC_TUNABLES'));"
            "print(allocator.tune())")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "KVJAX_MALLOC", "LD_PRELOAD")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tunables, applied = r.stdout.splitlines()
    if allocator.thp_mode() == "madvise":
        assert tunables == "glibc.malloc.hugetlb=1"
        if applied.startswith("glibc 2.") and int(applied.split()[1].split(".")[1].rstrip(":")) >= 35:
            assert applied.endswith("transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)")
    else:
        assert tunables == "None"


TCMALLOC = sorted(glob.glob("/usr/lib/*/libtcmalloc*.so.4") + glob.glob("/usr/lib/libtcmalloc*.so.4"))


@pytest.mark.skipif(not TCMALLOC, reason="no tcmalloc on this machine (apt-get install libtcmalloc-minimal4)")
def test_preloaded_tcmalloc_is_left_alone():
    env = {**os.environ, "LD_PRELOAD": TCMALLOC[0]}
    env.pop("KVJAX_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "tcmalloc (loaded into the process; left as it is)"


@pytest.mark.parametrize("module", ["kvjax.launch", "kvjax.serve"])
def test_bad_value_stops_the_programs_without_a_traceback(module):
    env = {**os.environ, "KVJAX_MALLOC": "fast"}
    out = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"{module}: error: KVJAX_MALLOC='fast': use 'tuned'" in out.stderr
    assert "Traceback" not in out.stderr


def test_allocator_benchmark_smoke(tmp_path):
    """launch.bench.allocator end to end with tiny settings: every allocator's worker runs and reports what applied."""
    out = tmp_path / "alloc.json"
    env = {**os.environ}
    env.pop("KVJAX_MALLOC", None)
    r = subprocess.run([sys.executable, "-m", "launch.bench.allocator", "--batches", "1", "2", "--context", "16",
                        "--capacity", "64", "--steps", "2", "--rounds", "1", "--cpus", "0", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    res = json.loads(out.read_text())
    assert res["applied"]["glibc defaults"] == "system allocator defaults (KVJAX_MALLOC=system)"
    assert set(res["ms_per_step"]["glibc defaults"]) == {"1", "2"}
    assert {name: len(runs) for name, runs in res["rounds"].items()} == {name: 1 for name in res["applied"]}
