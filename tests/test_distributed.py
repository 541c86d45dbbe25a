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
from kvjax.fitting.calibrate import collect_stats
from kvjax.mapper.pairing import depth_pairing
from kvjax.mapper.ridge import reference
from kvjax.fitting.residual import ResidualConfig
from kvjax.windows import sample, step_batch, step_starts
from maptools import VOCAB, assert_maps_match, tiny_pair

STEPS = 20
# Statistics vs one device, each entry relative to its Cauchy-Schwarz scale (stats_close). A float32 sum of k terms is
# within gamma(k) = k 2^-24 of sum |terms| for any summation order (vector width, sharding), and sum |x_i r_j| <=
# sqrt(sxx_i srr_j); so, per side, for chunks of at most N = 8 x 40 tokens:
#   the sums: gamma(N + 3) (+3: centring, product, output)                                            1.9e-5
#   the held-out residual r = y - x ref, formed per token over Fx = 32 terms, is off by gamma(Fx + 3)
#   (|y| + |x||ref|) <= 2.1e-6 x 8.4 |y| <= 1.8e-5 x 1.35 |r| (on this pair), twice in sum r^2          4.7e-5
#   a mean: gamma(log2 N + 2) mean |x| <= that x sqrt(mean x^2)                                         7e-7
# and the features themselves differ (forward passes sharded differently: measured <= 1.3e-6 of their largest entry,
# ~5e-6 in all). Two sides: <= 1.4e-4. Measured: <= 1.2e-6. (Was 1e-5 of each field's largest entry: below the
# bound for its sums, i.e. a tolerance that held by the luck of the summation order.)
STATS_TOL = 2e-4


def stats_close(got, want, what):
    """Every field within STATS_TOL of its Cauchy-Schwarz scale (see STATS_TOL)."""
    sxx, srr = np.diag(want.cxx), want.crr
    scale = dict(mx=np.sqrt(sxx / want.n + want.mx ** 2), my=np.sqrt(want.cyy / want.n + want.my ** 2),
                 cxx=np.sqrt(np.outer(sxx, sxx)), cxr=np.sqrt(np.outer(sxx, srr)), crr=srr)
    for name, sc in scale.items():
        err = (np.abs(getattr(got, name) - getattr(want, name)) / np.maximum(sc, 1e-30)).max()
        assert err <= STATS_TOL, f"{what} {name}: differs by {err:.1e} of its scale (tolerance {STATS_TOL:.0e})"


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
    want_k, want_v = collect_stats(s["source"], s["target"], pairing, [s["calib"][:8], s["calib"][8:]])
    got_k, _ = collect_stats(s["source"], s["target"], pairing, [s["calib"][:8], s["calib"][8:]], mesh=mesh)
    for g, w in zip(got_k, want_k):
        assert g.n == w.n == 16 * 40
        stats_close(g, w, "stats")
    refs = [(reference(k), reference(v)) for k, v in zip(want_k, want_v)]  # held-out: residuals around these
    want_h, _ = collect_stats(s["source"], s["target"], pairing, [s["held"]], refs=refs)
    got_h, _ = collect_stats(s["source"], s["target"], pairing, [s["held"]], mesh=mesh, refs=refs)
    for g, w in zip(got_h, want_h):
        np.testing.assert_array_equal(g.ref, w.ref)
        stats_close(g, w, "held-out stats")

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
    from kvjax.fitting.calibrate import model_on_mesh
    from maptools import native_cache
    mesh = sharding.make_mesh(data=2, model=4)
    cfg, params = model_on_mesh(setup["source"], mesh)
    assert params.layers[0].q.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)  # 4 heads / 4
    assert params.layers[0].k.sharding.spec == jax.sharding.PartitionSpec(None, None, None)  # 2 kv heads: replicated
    tokens = jax.device_put(setup["calib"][:8], sharding.data_sharding(mesh, (8, 40)))
    with jax.set_mesh(mesh):
        cache = jax.jit(native_cache, static_argnums=1)(params, cfg, tokens)
    assert cache.keys[0].sharding.spec[0] == "data"
    with pytest.raises(ValueError, match="multiple of 2"):
        sharding.data_sharding(mesh, (7, 40))
    opt_sh = sharding.optimizer_shardings(kvjax.fitting.residual.make_optimizer(RC, setup["kvmap"]), setup["kvmap"],
                                          kvjax.mapper.kvmap.kvmap_shardings(setup["kvmap"], mesh), mesh)
    assert all(s.mesh == mesh for s in jax.tree.leaves(opt_sh))


def test_token_windows_read_the_same_rows_as_the_eager_helpers():
    tokens = np.arange(5000, dtype=np.int32)
    lazy = distributed.TokenWindows.sample(tokens, 12, 64, seed=4)
    np.testing.assert_array_equal(np.asarray(lazy), sample(tokens, 12, 64, seed=4))
    np.testing.assert_array_equal(np.asarray(lazy[3:7]), sample(tokens, 12, 64, seed=4)[3:7])
    starts = step_starts(len(tokens), 5, 8, 32, seed=2)
    np.testing.assert_array_equal(np.asarray(distributed.TokenWindows(tokens, starts, 32)),
                                  step_batch(tokens, 5, 8, 32, seed=2))
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
