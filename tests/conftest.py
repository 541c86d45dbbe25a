"""Shared fixtures: tiny random Qwen3 checkpoints written by transformers' save_pretrained.

Tests run with 8 fake CPU devices, so the sharding tests and the single-device tests share one process.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# the test extra brings the TPU compiler (libtpu) for the compile-only plans (tests/test_plan.py): the tests run on
# CPU devices, and planning processes share libtpu without a TPU to guard (kvjax.plan.hardware)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # (kvjax.plan.hardware.compile_only_environment says why)
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the programs kvjax runs tune glibc's allocator to keep freed memory (kvjax.allocator); the test process runs
# hundreds of programs, so it keeps the C library's defaults (tests/test_allocator.py checks the tuning in a fresh
# process)
os.environ.setdefault("KVJAX_MALLOC", "system")
# most of the suite's time is XLA compiling the same small programs again, in other tests, in the other xdist
# worker, in the subprocesses the job and server tests start. One compilation cache for the whole run (set here in
# the controlling process, before the workers are spawned, so every process inherits it) compiles each program
# once. It starts empty every run and is removed at the end (pytest_unconfigure), so no run reads another's.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvjax-test-xla-")
    os.environ["KVJAX_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import dataclasses  # noqa: E402

import pytest  # noqa: E402


def pytest_unconfigure(config):
    """The run's compilation cache goes with the process that made it (not with a worker)."""
    if os.environ.get("KVJAX_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
        import shutil
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Tiny:
    """A tiny Qwen3 shape; defaults give GQA 2, untied head, head_dim != hidden / heads, odd layer count."""

    name: str
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 24
    ffn: int = 96
    vocab: int = 160
    tied: bool = False
    theta: float = 10_000.0

    def hf_config(self):
        import transformers
        return transformers.Qwen3Config(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, tie_word_embeddings=self.tied, max_position_embeddings=1024,
            rope_theta=self.theta, bos_token_id=1, eos_token_id=2, pad_token_id=0)


TINY = {
    "gqa2_untied_odd": Tiny("gqa2_untied_odd"),
    "gqa1_tied": Tiny("gqa1_tied", hidden=48, layers=2, heads=3, kv_heads=3, head_dim=16, tied=True),
    "gqa4_hd_big": Tiny("gqa4_hd_big", hidden=32, layers=1, heads=8, kv_heads=2, head_dim=32, theta=1e6),
}


def make_hf_model(tiny: Tiny, seed: int = 0, dtype=None):
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny.hf_config()).eval()
    with torch.no_grad():  # make norm weights non-trivial so a swapped or missing norm is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if dtype is not None:
        model = model.to(dtype)
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, torch model) for every TINY config, written once per session."""
    out = {}
    for name, tiny in TINY.items():
        model = make_hf_model(tiny)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: the suite compiles hundreds of models, and keeping every
    executable for the whole session grows one process by GBs (5.8 GB a dozen files in); a run of the suite
    on 2026-11-30 segfaulted inside XLA's compiler 26 files in, on a machine short of memory."""
    yield
    import gc
    import sys

    if "jax" not in sys.modules:
        return  # nothing imported JAX, so nothing was compiled (and a JAX-free test stays JAX-free)
    import jax
    jax.clear_caches()
    gc.collect()
