"""Pallas map-and-insert kernel (interpret mode: the GPU body and the TPU body under the TPU interpreter) against
its jnp reference, the apply_map impl switch, lowering for GPU/TPU, and the pipelined prefill + map."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.kernels import map_insert as mi
from kvjax.builders.pipelined import pipelined_prefill_map
from maptools import native_cache
from kvjax.mapper.kvmap import KVMap, LinearMap, spec_for

VOCAB = 96


def random_map(key, fx, fy, r, h, scale=1.0):
    ks = jax.random.split(key, 7)
    n = lambda k, shape, s: jax.random.normal(k, shape, jnp.float32) * s  # noqa: E731
    return LinearMap(mu=n(ks[0], (fx,), 0.5), scale=jnp.float32(1.7), w_in=n(ks[1], (fx, r), scale * fx ** -0.5),
                     w_out=n(ks[2], (r, fy), r ** -0.5), bias=n(ks[3], (fy,), 0.1),
                     down=n(ks[4], (fx, h), fx ** -0.5), res_bias=n(ks[5], (h,), 0.1),
                     up=n(ks[6], (h, fy), 0.5 * h ** -0.5))


# (src layers, B, Hs, Ts, hds, tgt layers, Ht, Tt, hdt, pairing, tgt_layers, rank, residual, length, src_off, dst_off)
CASES = {
    "gqa2to1_hd16to32_offsets": (3, 2, 2, 40, 16, 3, 1, 48, 32, ((1,), (2,)), (0, 2), 8, 4, 33, 3, 5),
    "gqa1to4_top2_hd32to16": (3, 1, 1, 24, 32, 2, 4, 30, 16, ((0, 2), (2, 1)), (1, 0), 12, 16, 24, 0, 0),
    "gqa4to2_short_block": (2, 2, 4, 16, 16, 1, 2, 24, 16, ((1,),), (0,), 8, 4, 7, 0, 9),
    # a server's chunk: the TPU body's blocks of 16 slots, 4 of them, both edge blocks partly outside the window
    "chunk_in_aligned_blocks": (3, 2, 2, 96, 16, 2, 2, 96, 32, ((2, 0), (1, 2)), (1, 0), 8, 4, 50, 37, 37),
}


def run_case(case, dtype, backend, weight_dtype=jnp.float32):
    ls, b, hs, ts, hds, lt, ht, tt, hdt, pairing, tgt_layers, r, h, n, so, do = CASES[case]
    ks = jax.random.split(jax.random.key(list(CASES).index(case)), 5)
    src_k, src_v = (jax.random.normal(k, (ls, b, hs, ts, hds)).astype(dtype) for k in ks[:2])
    tgt_k, tgt_v = (jax.random.normal(k, (lt, b, ht, tt, hdt)).astype(dtype) for k in ks[2:4])
    fx, fy = len(pairing[0]) * hs * hds, ht * hdt
    keys = [random_map(jax.random.fold_in(ks[4], 2 * j), fx, fy, r, h) for j in range(len(pairing))]
    values = [random_map(jax.random.fold_in(ks[4], 2 * j + 1), fx, fy, r, h) for j in range(len(pairing))]
    args = dict(pairing=pairing, tgt_layers=tgt_layers, length=n, src_rope=1e4, tgt_rope=5e5, src_offset=so,
                dst_offset=do)
    ref = mi.map_insert_reference(src_k, src_v, tgt_k, tgt_v, keys, values, **args)
    pack = lambda maps, **kw: mi.pack_maps(maps, fx // hds, ht, dtype=weight_dtype, backend=backend, **kw)  # noqa: E731
    out = mi.map_insert(src_k, src_v, jnp.array(tgt_k), jnp.array(tgt_v), pack(keys, keys=True), pack(values),
                        block_t=16, backend=backend, interpret=True, **args)
    return (tgt_k, tgt_v), ref, out, (tgt_layers, do, n)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference(case, dtype, backend):
    if backend == "mosaic_tpu" and dtype == jnp.bfloat16 and case != "gqa2to1_hd16to32_offsets":
        pytest.skip("one bf16 case under the TPU interpreter is enough (slow)")
    if backend == "triton" and case == "chunk_in_aligned_blocks":
        pytest.skip("blocks aligned in the caches are the TPU body's; the Triton body's are the other cases'")
    before, ref, out, (tgt_layers, do, n) = run_case(case, dtype, backend)
    atol = 1e-5 if dtype == jnp.float32 else 0.0625  # bf16: one rounding step of values of magnitude ~4
    for b0, r, o in zip(before, ref, out):
        assert o.dtype == r.dtype and o.shape == r.shape
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(r, np.float32), atol=atol, rtol=1e-2)
        mask = np.zeros(o.shape, bool)
        mask[list(tgt_layers), :, :, do:do + n] = True
        # everything outside the written window is the old buffer, bit for bit
        np.testing.assert_array_equal(np.asarray(o, np.float32)[~mask], np.asarray(b0, np.float32)[~mask])
        assert not np.allclose(np.asarray(o, np.float32)[mask], np.asarray(b0, np.float32)[mask])
    if dtype == jnp.float32:  # mismatch of a few ulps only: the same math, summed in another order
        assert float(jnp.max(jnp.abs(out[0] - ref[0]))) < 1e-4


def test_bf16_weights_stay_close():
    _, ref, out, _ = run_case("gqa2to1_hd16to32_offsets", jnp.float32, "triton", weight_dtype=jnp.bfloat16)
    for r, o in zip(ref, out):
        err = np.abs(np.asarray(o) - np.asarray(r)).max() / np.abs(np.asarray(r)).max()
        assert 0 < err < 2e-2


def test_donates_and_validates():
    b, hs, t, hd = 1, 2, 32, 16
    src = jnp.ones((2, b, hs, t, hd))
    tgt_k, tgt_v = jnp.zeros((1, b, hs, t, hd)), jnp.zeros((1, b, hs, t, hd))
    maps = [random_map(jax.random.key(0), hs * hd, hs * hd, 4, 2)]
    pack = mi.pack_maps(maps, hs, hs, backend="triton")
    args = dict(pairing=((1,),), tgt_layers=(0,), length=t, src_rope=1e4, tgt_rope=1e4, interpret=True)
    out = mi.map_insert(src, src, tgt_k, tgt_v, pack, pack, **args)
    assert tgt_k.is_deleted() and tgt_v.is_deleted()  # donated: written in place
    with pytest.raises(ValueError, match="cannot map 32 positions"):
        mi.map_insert(src, src, *out, pack, pack, **{**args, "length": 32}, dst_offset=1)
    with pytest.raises(ValueError, match="pack with pack_maps"):
        mi.map_insert(src, src, *out, mi.pack_maps(maps + maps, hs, hs), pack, **args)
    with pytest.raises(ValueError, match="interpret=True"):
        mi.map_insert(src, src, *out, pack, pack, **{**args, "interpret": False})
    with pytest.raises(ValueError, match="impl must be one of"):
        mi.resolve_impl("triton")
    assert mi.check_supported("triton", 128, 128, 1024) is None and mi.check_supported("mosaic_tpu", 128, 128, 16) is None
    assert "power-of-two" in mi.check_supported("triton", 24, 128, 1024)
    assert "multiple of 128" in mi.check_supported("mosaic_tpu", 64, 128, 1024)
    assert mi.check_supported("mosaic_tpu", 128, 64, 1024) is None  # Llama-3.2-1B's head dim, lanes doubled
    assert "multiple of 64" in mi.check_supported("mosaic_tpu", 128, 96, 1024)
    assert mi.check_supported("mosaic_tpu", 128, 128, 16, src_offset=37, dst_offset=37, src_len=4096,
                              tgt_len=4096) is None  # a chunk at an offset that is not a multiple of the block
    assert "multiples of 16" in mi.check_supported("mosaic_tpu", 128, 128, 16, src_offset=8, src_len=4096)
    assert "multiples of 16" in mi.check_supported("mosaic_tpu", 128, 128, 16, tgt_len=4104)


@pytest.mark.parametrize("platform,backend", [("cuda", "triton"), ("tpu", "mosaic_tpu")])
def test_lowers_for_gpu_and_tpu(platform, backend):
    """The real (non-interpret) lowerings on Qwen3-32B->8B-like shapes: Pallas -> Triton IR / Mosaic, from CPU, as
    an exported module (the compiles below go further: Mosaic's, and XLA's for a GPU where the plugin is here)."""
    from jax import export
    hs, hd, n, r, h = 8, 128, 300, 256, 16
    src = jax.ShapeDtypeStruct((4, 1, hs, 512, hd), jnp.bfloat16)
    tgt = jax.ShapeDtypeStruct((3, 1, hs, 512, hd), jnp.bfloat16)
    maps = [random_map(jax.random.key(j), hs * hd, hs * hd, r, h) for j in range(2)]
    pack = mi.pack_maps(maps, hs, hs, dtype=jnp.bfloat16, backend=backend)

    def f(sk, sv, tk, tv, pk, pv):
        return mi.map_insert_call(sk, sv, tk, tv, pk, pv, pairing=((3,), (1,)), tgt_layers=(2, 0), length=n,
                                  src_rope=1e6, tgt_rope=1e6, src_offset=5, dst_offset=5, backend=backend)

    exp = export.export(jax.jit(f, donate_argnums=(2, 3)), platforms=[platform],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        src, src, tgt, tgt, pack, pack)
    text = exp.mlir_module()
    assert ("tpu_custom_call" if backend == "mosaic_tpu" else "triton") in text
    assert text.count("tf.aliasing_output") == 2  # both target buffers updated in place


# ---- compiled for TPU (Mosaic) at the real pairs' shapes, no TPU needed -------------------------------------------

MODELS = pathlib.Path(__file__).resolve().parent.parent / "configs" / "models"


@pytest.fixture(scope="module")
def tpu_slices():
    """The devices of TPU slices, from the TPU compiler (libtpu), which compiles for them on this CPU."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs the TPU compiler (libtpu)")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chips here to guard with libtpu's lockfile
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies
    return lambda name: topologies.get_topology_desc(platform="tpu", topology_name=name).devices


def device_bytes(x) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize


@pytest.mark.parametrize("source,target,topology,length,offset,mesh_shape", [
    ("Qwen3-32B", "Qwen3-8B", "v5e:2x4", 4096, 0, (1, 8)),  # kv heads split 8 ways: all-to-alls around the kernel
    ("Qwen3-30B-A3B", "Qwen3-32B", "v5p:2x2x2", 16, 37, (1, 8)),  # a server's chunk; 4 source heads stay whole
    ("Llama-3.1-8B", "Llama-3.2-1B-Instruct", "v6e:2x4", 1000, 0, (1, 1)),  # head dim 128 -> 64, one chip
])
def test_kernel_compiles_for_tpu(tpu_slices, source, target, topology, length, offset, mesh_shape):
    """Mosaic compiles the kernel (lower + compile, nothing runs) at real pairs' cache shapes and lengths, two
    target layers of the map, on a slice's mesh; the compiled program writes the target in place and holds
    one device's share of each cache."""
    from kvjax.kernels.program import kernel_program
    src, tgt = (kvjax.load_hf_config(str(MODELS / name)) for name in (source, target))
    devices = tpu_slices(topology)[:mesh_shape[0] * mesh_shape[1]]
    prog = kernel_program(src, tgt, pairing=((0, 1), (6, 7)), tgt_layers=(0, 5), length=length, offset=offset,
                          devices=devices, mesh_shape=mesh_shape)
    compiled = prog.compile()
    text, mem = compiled.as_text(), compiled.memory_analysis()
    assert "tpu_custom_call" in text and ("all-to-all" in text) == (mesh_shape[1] > 1)
    _, _, tk, tv, kpack, vpack = prog.args
    assert mem.alias_size_in_bytes == device_bytes(tk) + device_bytes(tv)  # the target buffers, donated
    share = sum(device_bytes(x) for x in jax.tree.leaves(prog.args))  # each cache split, the weights whole
    assert share <= mem.argument_size_in_bytes < 1.01 * share  # (a few tiles of layout padding)
    assert compiled.cost_analysis()["flops"] >= prog.flops() / len(devices)


def test_apply_map_compiles_for_tpu(tpu_slices):
    """The library's own call of the kernel, map_jit(impl="pallas") (kvjax.builders.Mapped), compiles for a TPU
    mesh: Llama-3.1-Minitron-4B -> Llama-3.1-8B (llama3-scaled RoPE), two target layers, a 1,000-token prompt."""
    from kvjax import sharding
    from kvjax.builders.mapped import map_jit
    from kvjax.cache import axes, init_cache
    src, tgt = (kvjax.load_hf_config(str(MODELS / name)) for name in ("Llama-3.1-Minitron-4B-Width-Base",
                                                                      "Llama-3.1-8B"))
    mesh = sharding.make_mesh(2, 4, tpu_slices("v5e:2x4"))
    place = lambda tree, shardings: jax.tree.map(  # noqa: E731
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)
    cache = jax.eval_shape(lambda: init_cache(src, 2, 1024, jnp.bfloat16))
    cache = place(cache, sharding.tree_shardings(cache, axes(cache), mesh))
    pairing, fx, fy = ((3, 4), (20, 21)), 2 * src.num_kv_heads * src.head_dim, tgt.num_kv_heads * tgt.head_dim
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    layer = LinearMap(mu=f32(fx), scale=f32(), w_in=f32(fx, 256), w_out=f32(256, fy), bias=f32(fy),
                      down=f32(fx, 128), res_bias=f32(128), up=f32(128, fy))
    kvmap = KVMap(keys=(layer,) * 2, values=(layer,) * 2, spec=spec_for(src, tgt, pairing, 256, 128))
    kvmap = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.replicated(mesh)),
                         kvmap)
    with jax.set_mesh(mesh):
        compiled = map_jit.lower(kvmap, cache, capacity=1024, length=1000, impl="pallas").compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2  # one kernel call per target layer


def test_auto_takes_the_kernel_where_it_compiles_for_tpu(tpu_slices):
    """impl="auto" for a TPU mesh: the kernel where Mosaic compiles it, the XLA map where check_supported refuses
    (a source head dim not a multiple of 128; on one chip, a cache whose slots do not split into 16-slot blocks)."""
    from kvjax import sharding
    devices = tpu_slices("v5e:2x4")
    with jax.set_mesh(sharding.make_mesh(1, 1, devices[:1])):
        assert mi.resolve_impl("auto", 128, 64, 1000, src_len=1024, tgt_len=1024) == "pallas"  # Llama-3.2-1B
        assert mi.resolve_impl("auto", 64, 128, 1000) == "xla"
        assert mi.resolve_impl("auto", 128, 128, 1000, src_len=1024, tgt_len=1000) == "xla"
    with jax.set_mesh(sharding.make_mesh(1, 8, devices)):  # per device the kernel maps copied windows
        assert mi.resolve_impl("auto", 128, 128, 1000, src_len=1024, tgt_len=1000) == "pallas"
    assert mi.resolve_impl("auto", 128, 128, 1000) == "xla"  # no mesh: this process's CPU


def test_kernel_compiles_for_gpu():
    """The Triton body compiled for an H100 without a GPU, where the CUDA plugin and a ptxas are here (not in the
    default environment: kvjax.kernels.program.gpu_devices says what to install). In a fresh process: the plugin
    registers only if JAX has not started its backends without it."""
    import shutil
    import subprocess
    import sys
    pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for a GPU without one needs the "
                        "jax-cuda12-plugin and jax-cuda12-pjrt packages")
    if not (shutil.which("ptxas") or os.path.exists("/usr/local/cuda/bin/ptxas")):
        pytest.skip("XLA's GPU compiler needs a ptxas")
    code = f"""
import kvjax
from kvjax.kernels.program import gpu_devices, kernel_program
src, tgt = (kvjax.load_hf_config({str(MODELS)!r} + "/" + name) for name in ("Qwen3-32B", "Qwen3-8B"))
prog = kernel_program(src, tgt, pairing=((0, 1), (6, 7)), tgt_layers=(0, 5), length=1024, devices=gpu_devices())
compiled = prog.compile()
tk = prog.args[2]
print("triton" if "__gpu$xla.gpu.triton" in compiled.as_text() else "no triton call",
      compiled.memory_analysis().alias_size_in_bytes == 2 * tk.size * tk.dtype.itemsize)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["triton", "True"]


# ---- on a device mesh ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape,hs,ht,arrays", [((1, 8), 2, 8, 2), ((2, 4), 4, 2, 1)],
                         ids=["source_heads_whole", "target_heads_whole"])
def test_sharded_kernel_matches_reference(mesh_shape, hs, ht, arrays):
    """Caches sharded as the job shards them (batch over 'data', kv heads over 'model' where they divide): the
    kernel runs per device (positions split over 'model', traded with all-to-alls) and equals the XLA map; the
    source in one array, or one per pairing position (as map_layer passes them). The generic interpreter runs the
    body (the TPU interpreter does not run under shard_map on CPU devices)."""
    from kvjax import sharding
    from kvjax.cache import AXES
    ls, b, ts, hds, lt, tt, hdt = 3, 4, 64, 16, 2, 64, 32
    pairing, tgt_layers, n, off = ((2, 0), (1, 2)), (1, 0), 37, 5
    ks = jax.random.split(jax.random.key(7), 5)
    src_k, src_v = (jax.random.normal(k, (arrays, ls, b, hs, ts, hds)) for k in ks[:2])
    src_k, src_v = (tuple(a[p % arrays] for p in range(2)) for a in (src_k, src_v))
    tgt_k, tgt_v = (jax.random.normal(k, (lt, b, ht, tt, hdt)) for k in ks[2:4])
    fx, fy = 2 * hs * hds, ht * hdt
    keys = [random_map(jax.random.fold_in(ks[4], 2 * j), fx, fy, 8, 4) for j in range(2)]
    values = [random_map(jax.random.fold_in(ks[4], 2 * j + 1), fx, fy, 8, 4) for j in range(2)]
    args = dict(pairing=pairing, tgt_layers=tgt_layers, length=n, src_rope=1e4, tgt_rope=5e5, src_offset=off,
                dst_offset=off)
    ref = mi.map_insert_reference(src_k, src_v, tgt_k, tgt_v, keys, values, **args)
    mesh = sharding.make_mesh(*mesh_shape)
    put = lambda a: jax.device_put(a, sharding.named_sharding(AXES, a.shape, mesh))  # noqa: E731
    fn = jax.jit(lambda *c: mi.insert_layers(*c, keys, values, impl="pallas", backend="triton", interpret=True,
                                             **args))
    placed = jax.tree.map(put, (src_k, src_v, tgt_k, tgt_v))
    with jax.set_mesh(mesh):
        hlo = fn.lower(*placed).as_text()
        out = fn(*placed)
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo
    assert "all_to_all" in hlo and ("all_gather" in hlo) == (ht % mesh_shape[1] != 0)
    for o, r in zip(out, ref):
        # written in place, sharded as it came
        assert o.sharding.is_equivalent_to(sharding.named_sharding(AXES, r.shape, mesh), r.ndim)
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=1e-5, rtol=1e-5)


# ---- apply_map switch and the pipelined prefill -----------------------------------------------------------------

def model(layers, hidden, heads, kv_heads, head_dim, seed, theta):
    cfg = kvjax.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                            tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


def random_kvmap(source, target, pairing, rank=8, residual=4, seed=0) -> KVMap:
    (scfg, _), (tcfg, _) = source, target
    fx = len(pairing[0]) * scfg.num_kv_heads * scfg.head_dim
    fy = tcfg.num_kv_heads * tcfg.head_dim
    key = jax.random.key(seed)
    maps = [random_map(jax.random.fold_in(key, j), fx, fy, rank, residual, scale=3.0) for j in range(2 * len(pairing))]
    return KVMap(keys=tuple(maps[0::2]), values=tuple(maps[1::2]),
                 spec=spec_for(scfg, tcfg, pairing, rank, residual))


def map_tol(ref, positions: int, kvmap, extra: int = 0) -> float:
    """Worst-case first-order float32 difference between two implementations of the map: the kernel computes RoPE
    angles in float32 (p * f: 2 roundings, then cos / sin), the XLA map reads a host table, and keys are un-rotated
    and re-rotated (4 (p + 1) roundings at most), plus the dot products over the map's input features, plus `extra`
    roundings upstream; times the largest entry. Measured: 4.6e-7 of the largest entry (7.6 U)."""
    terms = 4 * (positions + 1) + kvmap.keys[0].w_in.shape[0] + extra
    return terms * 2.0 ** -24 * float(np.abs(np.asarray(ref)).max())


@pytest.fixture(scope="module")
def pair():
    source = model(4, 64, 4, 2, 16, seed=0, theta=1e4)
    target = model(2, 32, 4, 1, 32, seed=1, theta=5e3)
    return source, target, random_kvmap(source, target, ((0, 1), (1, 2)))  # source layer 3 is never needed


def test_apply_map_impls_agree(pair):
    source, _, kvmap = pair
    tokens = np.random.RandomState(0).randint(1, VOCAB, (2, 37)).astype(np.int32)
    cache = native_cache(source[1], source[0], jnp.asarray(tokens), jnp.asarray([37, 30]))
    ref = kvjax.apply_map(kvmap, cache, capacity=48)
    auto = kvjax.apply_map(kvmap, cache, capacity=48, impl="auto")  # XLA on CPU
    pallas = kvjax.apply_map(kvmap, cache, capacity=48, impl="pallas", interpret=True)
    np.testing.assert_array_equal(auto.k, ref.k)
    for got in (pallas, auto):
        np.testing.assert_allclose(got.k, ref.k, atol=map_tol(ref.k, 37, kvmap))
        np.testing.assert_allclose(got.v, ref.v, atol=map_tol(ref.v, 37, kvmap))
        np.testing.assert_array_equal(got.lengths, ref.lengths)
        assert got.origin == ref.origin and got.is_mapped
    with pytest.raises(ValueError, match="interpret=True"):
        kvjax.apply_map(kvmap, cache, impl="pallas")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_pipelined_prefill_map_equals_prefill_then_map(pair, impl):
    source, _, kvmap = pair
    tokens = np.random.RandomState(1).randint(1, VOCAB, (2, 37)).astype(np.int32)
    lengths = jnp.asarray([37, 29])
    ref = kvjax.apply_map(kvmap, native_cache(source[1], source[0], jnp.asarray(tokens), lengths), capacity=64,
                          length=37)
    got = pipelined_prefill_map(source, kvmap, tokens, lengths, capacity=64, impl=impl, interpret=impl == "pallas")
    assert got.k.shape == ref.k.shape and got.origin == ref.origin
    prefill_terms = 3 * (source[0].hidden_size + 37)  # the source layers run again, in another program
    np.testing.assert_allclose(got.k, ref.k, atol=map_tol(ref.k, 37, kvmap, prefill_terms))
    np.testing.assert_allclose(got.v, ref.v, atol=map_tol(ref.v, 37, kvmap, prefill_terms))
    np.testing.assert_array_equal(got.lengths, lengths)
    with pytest.raises(ValueError, match="fitted for source model"):
        pipelined_prefill_map(pair[1], kvmap, tokens)


def test_pipelined_split_path_gives_the_same_tokens(pair):
    """split_generate's phases with the pipelined prefill+map in place of prefill-then-map: same greedy tokens."""
    import math
    from kvjax.generation import CACHE_ALIGN, Sampling, pad_prompts
    from kvjax.generation import decode_loop
    from kvjax.models.decoder import decode_jit
    source, target, kvmap = pair
    prompts = [list(p) for p in np.random.RandomState(2).randint(1, VOCAB, (3, 30))]
    prompts[1] = prompts[1][:17]
    n_new = 10
    want = kvjax.split_generate(source, target, kvmap, prompts, n_new)
    got, phases = kvjax.split_generate(source, target, kvmap, prompts, n_new, pipeline=True, timings=True)
    np.testing.assert_array_equal(got, want)
    assert set(phases) == {"prefill_map", "first_token", "decode"}

    tokens, lengths = pad_prompts(prompts)
    t = tokens.shape[1] - 1
    capacity = math.ceil((t + 1 + n_new) / CACHE_ALIGN) * CACHE_ALIGN
    last = jnp.asarray(tokens[np.arange(len(tokens)), lengths - 1])
    for impl in ("xla", "pallas"):
        cache = pipelined_prefill_map(source, kvmap, tokens[:, :t], lengths - 1, capacity=capacity, impl=impl,
                                      interpret=impl == "pallas")
        logits, cache = decode_jit(target[1], target[0], last, cache)
        got = decode_loop(target[1], target[0], cache, logits, n_new, jax.random.key(0), Sampling(0.0, 1.0), (), 0)[0]
        np.testing.assert_array_equal(got, want)


def test_device_benchmark_smoke(capsys):
    """launch/bench/kernel.py end to end on CPU (tiny shapes, interpret mode), including its kernel-vs-XLA check."""
    from launch.bench import kernel as bench_kernel
    rows = bench_kernel.main(["--smoke"])
    assert {r["impl"] for r in rows} == {"xla f32", "pallas triton (interpret) bf16 weights",
                                         "pallas triton (interpret) f32 weights"}
    assert all(r["rel_err_vs_xla"] is None or r["rel_err_vs_xla"] < 2e-2 for r in rows)
    assert "GB/s" in capsys.readouterr().out
