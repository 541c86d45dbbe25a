"""The map-and-insert kernel as a program to compile ahead of time: its jitted function (`map_insert`'s) and the
abstract arguments it takes at a pair of models' cache shapes, on given devices — a TPU slice's or a GPU's from
`jax.experimental.topologies` (no accelerator needed), or this process's own.

`kernel_program(source, target, pairing=..., length=..., devices=...)` builds it; `.compile()` lowers it under its
mesh and compiles it, and XLA's `memory_analysis()` / `cost_analysis()` of the result describe one device's share.
The caches are sharded as the job shards them (kvjax.sharding.RULES: batch over 'data', kv heads over 'model'), so
on more than one device the program is the kernel's sharded form (kvjax.kernels.map_insert._sharded_call).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax import sharding
from kvjax.cache import AXES
from kvjax.kernels import map_insert as mi
from kvjax.models.rope import as_rope

BACKEND_OF_PLATFORM = {"tpu": "mosaic_tpu", "gpu": "triton", "cuda": "triton", "rocm": "triton"}
# XLA's GpuTargetConfig of an H100 SXM (its device description as XLA's xla/tools/hlo_opt/gpu_specs), with the
# cuDNN and CUDA runtime versions the jax-cuda12 plugin is built against: what gpu_devices compiles for
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@dataclasses.dataclass(frozen=True)
class KernelProgram:
    """`fn(*args, **kwargs)` is the kernel call (kwargs static); `mesh` is the one to lower it under."""

    fn: Any  # kvjax.aot.jit of map_insert_call (the jitted function map_insert calls), target buffers donated
    args: tuple  # (src_k, src_v, tgt_k, tgt_v, kpack, vpack) as jax.ShapeDtypeStructs with their shardings
    kwargs: dict
    mesh: Mesh

    def lower(self):
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*self.args, **self.kwargs)

    def compile(self):
        return self.lower().compile()

    def copy_bytes(self) -> int:
        """Bytes the call cannot avoid moving, over all devices: the paired source layers' keys and values for the
        mapped positions read once, the target's written once, and the packed weights read once."""
        src_k, _, tgt_k, _, kpack, vpack = self.args
        n, (_, b, hs, _, hds), (_, _, ht, _, hdt) = self.kwargs["length"], src_k.shape, tgt_k.shape
        paired = {s for p in self.kwargs["pairing"] for s in p}
        weights = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((kpack, vpack)))
        return (2 * b * n * (len(paired) * hs * hds * jnp.dtype(src_k.dtype).itemsize
                             + len(self.kwargs["tgt_layers"]) * ht * hdt * jnp.dtype(tgt_k.dtype).itemsize)
                + weights)

    def flops(self) -> int:
        """The map's matmul FLOPs over all devices (keys and values; the kernel's own count, its CostEstimate)."""
        src_k, _, tgt_k, _, kpack, _ = self.args
        n_tok = len(self.kwargs["tgt_layers"]) * src_k.shape[1] * self.kwargs["length"]
        fx, fy = kpack.w_in.shape[1] * kpack.w_in.shape[2], tgt_k.shape[2] * tgt_k.shape[4]
        return 2 * 2 * n_tok * (kpack.w_in.shape[3] + kpack.down.shape[3]) * (fx + fy)


def gpu_devices(target_config: str = H100_SXM, topology: str = "1x1x1") -> list:
    """Devices of GPUs this machine need not have (default: one H100 SXM), from the CUDA PJRT plugin: install
    jax-cuda12-plugin and jax-cuda12-pjrt of the installed jax's version, and have a `ptxas` (a CUDA toolkit's, or
    the nvidia-cuda-nvcc-cu12 wheel's), which XLA's GPU compiler runs. Programs compiled for them give XLA's memory
    analysis (no cost analysis). Call it before JAX starts its backends, or run with JAX_PLATFORMS=cpu: otherwise the
    plugin looks for the CUDA libraries and a GPU, finds none, and does not register."""
    import os

    from jax.experimental import topologies
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries to check: compiling only
    try:
        return list(topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                                 topology=topology).devices)
    except Exception as e:  # no plugin: the message says what to install
        raise RuntimeError(f"no CUDA topology ({str(e).strip().splitlines()[0][:200]}): compiling for a GPU without "
                           "one needs the jax-cuda12-plugin and jax-cuda12-pjrt packages of the installed jax's "
                           "version, and a ptxas") from None


def kv_geometry(cfg) -> tuple[int, int, int, Any]:
    """(layers, kv heads, head dim, Rope) of a model config (any kvjax family's: num_layers, num_kv_heads,
    head_dim, rope)."""
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, as_rope(cfg.rope)


def abstract_pack(layers: int, in_heads: int, src_head_dim: int, out_heads: int, tgt_head_dim: int, rank: int,
                  residual: int, *, dtype, backend: str, keys: bool) -> mi.PackedMap:
    """The PackedMap `pack_maps` makes of `layers` maps of these shapes (ShapeDtypeStructs)."""
    fx, fy = in_heads * src_head_dim, out_heads * tgt_head_dim

    def pack():
        z = jnp.zeros
        m = types.SimpleNamespace(mu=z(fx), scale=jnp.ones(()), w_in=z((fx, rank)), w_out=z((rank, fy)), bias=z(fy),
                                  down=z((fx, residual)), res_bias=z(residual), up=z((residual, fy)))
        return mi.pack_maps([m] * layers, in_heads, out_heads, dtype=dtype, backend=backend, keys=keys)

    return jax.eval_shape(pack)


def kernel_program(source, target, *, pairing: Sequence[Sequence[int]], length: int, devices: Sequence,
                   tgt_layers: Sequence[int] | None = None, rank: int = 256, residual: int = 128, batch: int = 1,
                   capacity: int | None = None, offset: int = 0, dtype=jnp.bfloat16, weight_dtype=jnp.float32,
                   mesh_shape: tuple[int, int] | None = None, backend: str | None = None,
                   block_t: int | None = None, interpret: bool = False) -> KernelProgram:
    """The kernel mapping `length` positions from slot `offset` of a `source` cache into a `target` cache, for the
    target layers `tgt_layers` (default: all; tgt_layers[j] reads source layers pairing[j]), at the models' cache
    geometry (configs: kv_geometry), ridge rank `rank`, residual width `residual`, on `devices` as a
    ('data', 'model') mesh of `mesh_shape` (default: every device on 'model').

    Caches hold `capacity` slots (default: offset + length rounded up to kvjax's 128) in `dtype`; the packed
    weights are `weight_dtype` (the library's default float32; bfloat16 halves their bytes and runs the MXU at its
    bf16 rate). `backend` defaults to the devices' platform's (Mosaic on TPU, Triton on GPU); on CPU devices pass
    interpret=True."""
    devices = list(devices)
    ls, hs, hds, src_rope = kv_geometry(source)
    lt, ht, hdt, tgt_rope = kv_geometry(target)
    tgt_layers = tuple(range(lt)) if tgt_layers is None else tuple(int(t) for t in tgt_layers)
    pairing = tuple(tuple(int(s) for s in p) for p in pairing)
    if len(pairing) != len(tgt_layers) or len({len(p) for p in pairing}) != 1:
        raise ValueError(f"one tuple of source layers, all of one length, per mapped target layer: got "
                         f"{len(pairing)} tuples for {len(tgt_layers)} target layers")
    platform = devices[0].platform
    backend = backend or BACKEND_OF_PLATFORM.get(platform)
    if backend is None:
        if not interpret:
            raise ValueError(f"no Pallas backend compiles for {platform} devices: pass TPU or GPU devices, or "
                             "interpret=True")
        backend = "triton"
    data, model = mesh_shape or (1, len(devices))
    mesh = sharding.make_mesh(data, model, devices)
    capacity = capacity or -(-(offset + length) // 128) * 128

    def cache(layers, heads, head_dim):
        shape = (layers, batch, heads, capacity, head_dim)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding.named_sharding(AXES, shape, mesh))

    replicate = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    width = len(pairing[0])
    packs = [jax.tree.map(replicate, abstract_pack(len(tgt_layers), width * hs, hds, ht, hdt, rank, residual,
                                                   dtype=jnp.dtype(weight_dtype), backend=backend, keys=keys))
             for keys in (True, False)]
    src, tgt = cache(ls, hs, hds), cache(lt, ht, hdt)
    kwargs = dict(pairing=pairing, tgt_layers=tgt_layers, length=int(length), src_rope=src_rope, tgt_rope=tgt_rope,
                  src_offset=int(offset), dst_offset=int(offset), block_t=block_t, backend=backend,
                  interpret=bool(interpret))
    return KernelProgram(mi.map_insert_jit, (src, src, tgt, tgt, *packs), kwargs, mesh)
