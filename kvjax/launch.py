"""`python -m kvjax.launch`: the main job.

Until the cache-map job lands (issue 5), this runs the foundation end to end as a user would: it writes a small
random Qwen3 checkpoint in HF format (or takes --checkpoint), loads it through kvjax.load_hf, and generates from a
batch of prompts of different lengths, reporting compile, prefill and decode times.
"""

from __future__ import annotations

import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import kvjax
from kvjax.models.params import init_params

CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF Qwen3 checkpoint dir; default: a random one made under --out")
OUT = flags.DEFINE_string("out", "runs/demo", "Directory for artifacts of this run")
NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and cache dtype")

log = logging.getLogger("kvjax.launch")

DEMO_CONFIG = kvjax.Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                                num_kv_heads=4, head_dim=32, rope_theta=1e6, eos_token_ids=(), pad_token_id=0)


def demo_checkpoint(out: str) -> str:
    path = os.path.join(out, "random-qwen3")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        log.info("writing a random Qwen3 checkpoint (%.1fM params) to %s", DEMO_CONFIG.num_params() / 1e6, path)
        kvjax.save_hf(path, DEMO_CONFIG, init_params(DEMO_CONFIG, jax.random.key(0)))
    return path


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.info("process %d of %d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    path = CHECKPOINT.value or demo_checkpoint(OUT.value)
    t0 = time.perf_counter()
    cfg, params = kvjax.load_hf(path, dtype=jnp.dtype(DTYPE.value))
    log.info("loaded %s in %.2fs: %d layers, hidden %d, %.1fM params", path, time.perf_counter() - t0,
             cfg.num_layers, cfg.hidden_size, cfg.num_params() / 1e6)

    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, cfg.vocab_size, n).tolist() for n in (200, 57, 130, 9)]
    n = NEW_TOKENS.value
    t0 = time.perf_counter()
    out = jax.block_until_ready(kvjax.generate(params, cfg, prompts, max_new_tokens=n, eos_token_ids=()))
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(kvjax.generate(params, cfg, prompts, max_new_tokens=n, eos_token_ids=()))
        times.append(time.perf_counter() - t0)
    run = float(np.median(times))
    log.info("generate: batch %d, prompts %s tokens, %d new tokens each", len(prompts),
             [len(p) for p in prompts], n)
    log.info("first call (with compile) %.2fs; then %.3fs per call = %.0f new tokens/s", first, run,
             len(prompts) * n / run)
    for p, row in zip(prompts, np.asarray(out)):
        print(f"prompt[{len(p):3d} tok] ... -> {row[:12].tolist()} ...")
    print("kvjax foundation demo OK (the cache-map job lands with `python -m kvjax.launch --config=toy`).")


if __name__ == "__main__":
    app.run(main)
