"""Map fitting and residual training on 8 fake CPU devices (several mesh shapes) equal one device; the pieces of
kvjax.distributed that do not need a second process."""

import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import kvjax
from kvjax import distributed, sharding
from kvjax.mapper.calibrate import collect_stats
from kvjax.mapper.pairing import depth_pairing
from kvjax.mapper.residual import ResidualConfig, batch_starts
from maptools import VOCAB, assert_maps_match, close, tiny_pair

STEPS = 20
STATS_RTOL = 1e-5  # statistics vs one device, relative to their largest entry (float32 chunk sums)


def windows(n, t, seed):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


RC = ResidualConfig(steps=STEPS, batch_size=8, prefix_len=24, cont_len=8, lr=1e-2, warmup_steps=2, save_every=10)


@pytest.fixture(scope="module")
def setup():
    source, target = tiny_pair()
    calib, held = windows(16, 40, 0), windows(8, 40, 1)
    tokens = np.random.RandomState(3).randint(1, VOCAB, 6000).astype(np.uint16)
    kvmap, report = kvjax.fit_map(source, target, calib, held, batch_size=8, residual_rank=4)
    trained, hist = kvjax.train_residual(kvmap, source, target, tokens, RC)
    return dict(source=source, target=target, calib=calib, held=held, tokens=tokens, kvmap=kvmap, report=report,
                trained=trained, hist=hist)


@pytest.mark.parametrize("data, model_axis", [(8, 1), (4, 2), (2, 4)])
def test_sharded_fit_and_residual_match_single_device(setup, data, model_axis):
    assert jax.device_count() == 8, "conftest sets XLA_FLAGS=--xla_force_host_platform_device_count=8"
    s = setup
    mesh = sharding.make_mesh(data=data, model=model_axis)

    pairing = depth_pairing(3, 2)
    want_k, _ = collect_stats(s["source"], s["target"], pairing, [s["calib"][:8], s["calib"][8:]])
    got_k, _ = collect_stats(s["source"], s["target"], pairing, [s["calib"][:8], s["calib"][8:]], mesh=mesh)
    for g, w in zip(got_k, want_k):
        assert g.n == w.n == 16 * 40
        for name in ("mx", "my", "cxx", "cxy", "cyy"):
            close(getattr(g, name), getattr(w, name), STATS_RTOL, f"stats {name}")

    kvmap, report = kvjax.fit_map(s["source"], s["target"], s["calib"], s["held"], batch_size=8, residual_rank=4,
                                  mesh=mesh)
    assert [[r[k]["lambda"] for k in ("key", "value")] for r in report["layers"]] == \
        [[r[k]["lambda"] for k in ("key", "value")] for r in s["report"]["layers"]]
    assert_maps_match(kvmap, s["kvmap"])
    leaf = kvmap.keys[0].w_in
    assert leaf.sharding.mesh == mesh and leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8

    compiles = []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        trained, hist = kvjax.train_residual(kvmap, s["source"], s["target"], s["tokens"], RC, mesh=mesh)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) < STEPS // 2, f"{len(compiles)} compilations in {STEPS} steps: the step recompiles"
    np.testing.assert_allclose([h["kl"] for h in hist], [h["kl"] for h in s["hist"]], rtol=2e-5)
    assert_maps_match(trained, s["trained"])
    assert trained.keys[0].up.sharding.mesh == mesh
    assert np.abs(np.asarray(trained.keys[0].up)).max() > 1e-3  # it did train


def test_sharded_params_and_caches_follow_the_logical_rules(setup):
    from kvjax.mapper.calibrate import model_on_mesh, native_cache
    mesh = sharding.make_mesh(data=2, model=4)
    cfg, params = model_on_mesh(setup["source"], mesh)
    assert params.layers[0].q.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)  # 4 heads / 4
    assert params.layers[0].k.sharding.spec == jax.sharding.PartitionSpec(None, None, None)  # 2 kv heads: replicated
    tokens = jax.device_put(setup["calib"][:8], sharding.data_sharding(mesh, (8, 40)))
    with jax.set_mesh(mesh):
        cache = jax.jit(native_cache, static_argnums=1)(params, cfg, tokens)
    assert cache.k.sharding.spec[1] == "data"
    with pytest.raises(ValueError, match="multiple of 2"):
        sharding.data_sharding(mesh, (7, 40))
    opt_sh = sharding.optimizer_shardings(kvjax.mapper.residual.make_optimizer(RC, setup["kvmap"]), setup["kvmap"],
                                          sharding.kvmap_shardings(setup["kvmap"], mesh), mesh)
    assert all(s.mesh == mesh for s in jax.tree.leaves(opt_sh))


def test_token_windows_read_the_same_rows_as_the_eager_helpers():
    from kvjax.mapper.data import windows_from_tokens
    from kvjax.pretrain import batch_at
    tokens = np.arange(5000, dtype=np.int32)
    lazy = distributed.TokenWindows.sample(tokens, 12, 64, seed=4)
    np.testing.assert_array_equal(np.asarray(lazy), windows_from_tokens(tokens, 12, 64, seed=4))
    np.testing.assert_array_equal(np.asarray(lazy[3:7]), windows_from_tokens(tokens, 12, 64, seed=4)[3:7])
    starts = batch_starts(len(tokens), 5, 8, 31, seed=2)
    np.testing.assert_array_equal(np.asarray(distributed.TokenWindows(tokens, starts, 32)),
                                  batch_at(tokens, 5, 8, 31, seed=2))
    with pytest.raises(ValueError, match="window starts must lie"):
        distributed.TokenWindows(tokens, [4990], 64)


def test_global_batch_reads_local_rows_and_pads():
    mesh = sharding.make_mesh(data=4, model=2)
    rows = np.arange(6 * 5, dtype=np.int32).reshape(6, 5)
    sh = sharding.data_sharding(mesh, (8, 5))
    assert distributed.local_rows(sh, (8, 5)) == slice(0, 8)  # one process holds every row
    batch = distributed.global_batch(rows, sh, (8, 5))
    np.testing.assert_array_equal(np.asarray(batch)[:6], rows)
    assert not np.asarray(batch)[6:].any()
    assert batch.sharding.spec[0] == "data"


def test_f64_travels_exactly_as_float32_pairs():
    x = np.random.RandomState(0).randn(50) * 1e6 + 1 / 3
    hi, lo = distributed.split_f64(x)
    assert hi.dtype == lo.dtype == np.float32
    back = distributed.join_f64(hi, lo)
    assert np.abs(back - x).max() <= 1e-13 * np.abs(x).max()  # ~48 bits, vs ~24 for float32 alone
    assert np.abs(hi.astype(np.float64) - x).max() > 1e-3  # float32 alone would not do
    np.testing.assert_array_equal(distributed.allgather_f64([x])[0][0], x)  # one process: untouched


def test_initialize_is_explicit_about_what_is_missing(monkeypatch):
    for name in (distributed.ENV_ADDRESS, distributed.ENV_NUM, distributed.ENV_ID):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize(mode="off") is False
    assert distributed.initialize() is False  # nothing configured: a single-process run
    with pytest.raises(ValueError, match="no coordinator address"):
        distributed.initialize(num_processes=2)
    monkeypatch.setenv(distributed.ENV_ADDRESS, "127.0.0.1:1")
    with pytest.raises(ValueError, match="--num-processes and --process-id"):
        distributed.initialize()
    jax.devices()  # the backend is up (as in every test process)
    with pytest.raises(RuntimeError, match="must run before anything uses a JAX device"):
        distributed.initialize(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='x' is not an integer"):
        monkeypatch.setenv(distributed.ENV_ID, "x")
        distributed.initialize()


def test_watchdog_exits_when_progress_stops():
    code = ("import time; from kvjax import distributed\n"
            "with distributed.Watchdog(1.0):\n"
            "    for _ in range(4):\n"
            "        time.sleep(0.3); distributed.heartbeat()\n"
            "    print('stalling', flush=True); time.sleep(60)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == distributed.EXIT_STALLED, proc.stderr[-2000:]
    assert "stalling" in proc.stdout and "A peer process has probably died or hung" in proc.stderr
    assert time.monotonic() - t0 < 30
