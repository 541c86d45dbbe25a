"""Maps and residual checkpoints are portable across topologies: what a 2 x 2 mesh of 4 fake devices saves loads,
applies and resumes on one device (each side in its own process, as a user moving a map from a pod to a laptop).

Tolerances: the map arrays travel bit-exactly (compared with assert_array_equal); the cache the loaded map gives on
one device is compared with the cache the same map gave sharded over the mesh, which sums in another order, so it
agrees to float32 rounding (rtol 1e-5). The resumed residual ran 2 of its steps on the mesh, so it matches a
one-device run within maptools' tolerances for sharded training."""

import os
import subprocess
import sys
import textwrap

import numpy as np

import kvjax
from maptools import VOCAB, assert_maps_equal, assert_maps_match, tiny_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

COMMON = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    import kvjax
    from maptools import native_cache
    from kvjax.fitting.residual import ResidualConfig
    from maptools import VOCAB, tiny_pair
    out = sys.argv[1]
    source, target = tiny_pair()
    calib = np.random.RandomState(0).randint(1, VOCAB, (8, 40)).astype(np.int32)
    held = np.random.RandomState(1).randint(1, VOCAB, (4, 40)).astype(np.int32)
    probe = np.random.RandomState(2).randint(1, VOCAB, (4, 32)).astype(np.int32)
    tokens = np.random.RandomState(3).randint(1, VOCAB, 3000).astype(np.uint16)
    rc = ResidualConfig(steps=4, batch_size=4, prefix_len=16, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2)
    def mapped_cache(kvmap):
        cache = kvjax.apply_map(kvmap, native_cache(source[1], source[0], jnp.asarray(probe)))
        return {{"k": np.asarray(cache.k), "v": np.asarray(cache.v)}}
""")

ON_MESH = COMMON + textwrap.dedent("""
    from kvjax import sharding
    assert jax.device_count() == 4
    mesh = sharding.make_mesh(2, 2)
    kvmap, _ = kvjax.fit_map(source, target, calib, held, batch_size=4, residual_rank=4, mesh=mesh)
    assert len(kvmap.keys[0].w_in.sharding.device_set) == 4
    kvjax.save_map(os.path.join(out, "map"), kvmap)
    with jax.set_mesh(mesh):
        np.savez(os.path.join(out, "mesh_cache.npz"), **mapped_cache(kvmap))
    kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=os.path.join(out, "residual"), stop_at=2,
                         mesh=mesh)
    print("saved on", mesh.shape, flush=True)
""")

ONE_DEVICE = COMMON + textwrap.dedent("""
    assert jax.device_count() == 1
    kvmap = kvjax.load_map(os.path.join(out, "map"), source[0], target[0])
    assert kvmap.keys[0].w_in.sharding.device_set == {{jax.devices()[0]}}
    got, want = mapped_cache(kvmap), np.load(os.path.join(out, "mesh_cache.npz"))
    for name in ("k", "v"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6 * np.abs(want[name]).max())
    resumed, hist = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=os.path.join(out, "residual"))
    assert [h["step"] for h in hist] == [3, 4], hist
    kvjax.save_map(os.path.join(out, "resumed"), resumed)
    print("loaded, applied and resumed on one device", flush=True)
""")


def run_with_devices(code: str, devices: int, out) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-c", code.format(tests=TESTS), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_map_and_residual_checkpoint_saved_on_a_2x2_mesh_load_apply_and_resume_on_one_device(tmp_path):
    saved = run_with_devices(ON_MESH, 4, tmp_path)
    assert saved.returncode == 0, saved.stderr[-4000:]
    loaded = run_with_devices(ONE_DEVICE, 1, tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert "loaded, applied and resumed on one device" in loaded.stdout
    source, target = tiny_pair()  # the same fit and 4 steps, uninterrupted, on one device of this process
    rs = lambda seed, shape: np.random.RandomState(seed).randint(1, VOCAB, shape).astype(np.int32)  # noqa: E731
    from kvjax.fitting.residual import ResidualConfig
    rc = ResidualConfig(steps=4, batch_size=4, prefix_len=16, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2)
    kvmap, _ = kvjax.fit_map(source, target, rs(0, (8, 40)), rs(1, (4, 40)), batch_size=4, residual_rank=4)
    straight, _ = kvjax.train_residual(kvmap, source, target, rs(3, 3000).astype(np.uint16), rc)
    assert_maps_match(kvjax.load_map(str(tmp_path / "resumed")), straight)
    # ... and in this process (8 devices), replicated over a mesh it was not saved on
    from jax.sharding import NamedSharding, PartitionSpec
    from kvjax import sharding
    mesh = sharding.make_mesh(4, 2)
    replicated = kvjax.load_map(str(tmp_path / "map"), sharding=NamedSharding(mesh, PartitionSpec()))
    assert replicated.keys[0].w_in.sharding.is_fully_replicated and len(replicated.keys[0].w_in.sharding.device_set) == 8
    assert_maps_equal(replicated, kvjax.load_map(str(tmp_path / "map")))
    assert np.asarray(replicated.keys[0].w_in).dtype == np.float32
