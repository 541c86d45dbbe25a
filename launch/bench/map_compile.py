"""The cache map compiled for accelerators this machine does not have: the Pallas map-and-insert kernel and the XLA
map, per real pair and TPU slice, with XLA's memory and cost analysis against the copy bound.

    python -m launch.bench.map_compile                       # every pair on v5e:2x4, v6e:2x4, v5p:2x2x2
    python -m launch.bench.map_compile --pairs qwen32_8 --topologies v5e:2x4 --lengths 4096 16384
    python -m launch.bench.map_compile --chunk 16@37         # a server's chunk: 16 positions at slot 37
    PYTHONPATH=.:PLUGIN python -m launch.bench.map_compile --topologies h100   # one H100, deviceless (below)

Per (pair, slice, length): both programs map every target layer of the pair (two paired source layers each, the
nearest in depth; ridge rank 256, residual 128, float32 weights as the library packs them by default, bfloat16
caches of batch 1 sharded as the job shards them: kv heads over an 8-way 'model' axis) into the target cache in
place: the kernel through kvjax.kernels.program.kernel_program, the XLA map as kvjax.kernels.map_insert.insert_layers
(impl="xla") on the same arguments. Printed per device: XLA's memory analysis (arguments, outputs, aliased,
temporaries), its cost analysis (FLOPs, bytes accessed; a Pallas call's own figures are its CostEstimate, the
operations around it XLA's count), the copy bound (the paired source keys and values for the mapped positions read,
the target's written, the weights read: bytes no implementation can avoid) and three times at the chip's peak: the
copy time (copy bytes / HBM bandwidth) and each program's roofline, max(FLOPs / peak bf16 FLOP/s, bytes accessed /
HBM bandwidth). One JSON line per program goes to --out.

"h100" compiles for one H100 SXM without a GPU: the CUDA PJRT plugin (jax-cuda12-plugin and jax-cuda12-pjrt of the
installed jax's version; PLUGIN above is a directory they were installed in, e.g. `pip install --target`, or install
them into the environment), a `ptxas` (a CUDA toolkit's, or the nvidia-cuda-nvcc-cu12 wheel's) and the GPU's target
description (kvjax.kernels.program.H100_SXM). The GPU compiler gives a memory analysis but no cost analysis: the GPU
rows' FLOPs and bytes are the map's arithmetic (kernel_program's FLOPs, the copy bound), not XLA's count.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

# Per chip: HBM bandwidth (bytes/s), peak bf16 dense FLOP/s (Google Cloud TPU documentation; NVIDIA's H100 SXM).
CHIPS = {"v5e": (819e9, 197e12), "v6e": (1640e9, 918e12), "v5p": (2770e9, 459e12), "h100": (3.35e12, 989e12)}

MODELS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "models"
PAIRS = {
    "qwen32_8": ("Qwen3-32B", "Qwen3-8B"),
    "qwen30a3_32": ("Qwen3-30B-A3B", "Qwen3-32B"),
    "minitron4_llama8": ("Llama-3.1-Minitron-4B-Width-Base", "Llama-3.1-8B"),
    "llama70_8": ("Llama-3.3-70B-Instruct", "Llama-3.1-8B"),
    "llama8_1": ("Llama-3.1-8B", "Llama-3.2-1B-Instruct"),
}


def nearest_pairing(n_source: int, n_target: int, width: int) -> tuple[tuple[int, ...], ...]:
    """`width` consecutive source layers per target layer, centred on the nearest in depth."""
    from kvjax.mapper.pairing import depth_pairing
    return tuple(tuple(min(max(s - width // 2, 0), n_source - width) + j for j in range(width))
                 for (s,) in depth_pairing(n_source, n_target))


def devices_of(name: str):
    """(devices, chip) of a "v5e:2x4"-style TPU slice, or of "h100" (one, from the CUDA plugin: no GPU needed)."""
    from jax.experimental import topologies
    if name == "h100":
        from kvjax.kernels.program import gpu_devices
        return gpu_devices(), name
    return topologies.get_topology_desc(platform="tpu", topology_name=name).devices, name.split(":")[0]


def xla_program(prog):
    """The XLA map (insert_layers impl="xla") on the kernel program's arguments, with LinearMaps of its shapes."""
    import jax
    import jax.numpy as jnp

    from kvjax.kernels import map_insert as mi
    from kvjax.mapper.kvmap import LinearMap
    from kvjax.sharding import replicated
    src_k, _, tgt_k, _, kpack, _ = prog.args
    kw = prog.kwargs
    fx = kpack.w_in.shape[1] * kpack.w_in.shape[2]
    fy, r, h = tgt_k.shape[2] * tgt_k.shape[4], kpack.w_in.shape[3], kpack.down.shape[3]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=replicated(prog.mesh))  # noqa: E731
    layer = LinearMap(mu=f32(fx), scale=f32(), w_in=f32(fx, r), w_out=f32(r, fy), bias=f32(fy), down=f32(fx, h),
                      res_bias=f32(h), up=f32(h, fy))
    n = len(kw["tgt_layers"])
    maps = (tuple([layer] * n), tuple([layer] * n))
    static = {k: kw[k] for k in ("pairing", "tgt_layers", "length", "src_rope", "tgt_rope", "src_offset",
                                 "dst_offset")}

    def fn(src_k, src_v, tgt_k, tgt_v, keys, values):
        return mi.insert_layers(src_k, src_v, tgt_k, tgt_v, keys, values, impl="xla", **static)

    return jax.jit(fn, donate_argnums=(2, 3)), (src_k, src_k, tgt_k, tgt_k, *maps)


def measure(name, fn, args, kwargs, mesh, chip, copy_bytes, flops, devices):
    import jax
    bw, peak = CHIPS[chip]
    row = dict(program=name)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args, **kwargs).compile()
    except Exception as e:  # the compiler's refusal is the result
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240]}"
        return row
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    copy = copy_bytes / devices
    if cost:  # XLA's count
        flops, nbytes = float(cost.get("flops", 0)), float(cost.get("bytes accessed", 0))
    else:  # the GPU compiler has no cost analysis: the arithmetic
        flops, nbytes = flops / devices, copy
        row["counted_by"] = "arithmetic"
    row.update(compile_s=round(time.perf_counter() - t0, 1), argument_mb=mem.argument_size_in_bytes / 1e6,
               output_mb=mem.output_size_in_bytes / 1e6, alias_mb=mem.alias_size_in_bytes / 1e6,
               temp_mb=mem.temp_size_in_bytes / 1e6, gflops=flops / 1e9, accessed_mb=nbytes / 1e6,
               copy_mb=copy / 1e6, copy_us=copy / bw * 1e6, flops_us=flops / peak * 1e6,
               roofline_us=max(flops / peak, nbytes / bw) * 1e6)
    row["vs_copy"] = row["roofline_us"] / row["copy_us"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--topologies", nargs="+", default=["v5e:2x4", "v6e:2x4", "v5p:2x2x2"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096])
    ap.add_argument("--chunk", nargs="*", default=[], help="N@SLOT: also map N positions at slot SLOT (a server's "
                    "chunk)")
    ap.add_argument("--layers", type=int, default=0, help="map only the first N target layers (quick sweeps)")
    ap.add_argument("--programs", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
    ap.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mesh", default="", help="DATAxMODEL devices of the slice to use (default: 1 x all)")
    ap.add_argument("--out", default="", help="append one JSON line per program here")
    a = ap.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU chips here to guard
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import jax.numpy as jnp

    import kvjax
    from kvjax.kernels.program import kernel_program
    shapes = [(n, 0) for n in a.lengths] + [tuple(int(x) for x in c.split("@")) for c in a.chunk]
    out = open(a.out, "a") if a.out else None
    print(f"{'pair':18s} {'slice':10s} {'len@slot':>9s} {'program':7s} {'args MB':>8s} {'temp MB':>8s} "
          f"{'GFLOP':>7s} {'acc MB':>8s} {'copy MB':>8s} {'copy us':>8s} {'roof us':>8s} {'x copy':>6s}")
    for topo in a.topologies:
        devices, chip = devices_of(topo)
        data, model = (int(x) for x in a.mesh.split("x")) if a.mesh else (1, len(devices))
        devices = devices[:data * model]
        for pair in a.pairs:
            src, tgt = (kvjax.load_hf_config(str(MODELS / m)) for m in PAIRS[pair])
            pairing = nearest_pairing(src.num_layers, tgt.num_layers, 2)
            layers = tuple(range(a.layers or tgt.num_layers))
            for length, slot in shapes:
                prog = kernel_program(src, tgt, pairing=pairing[:len(layers)], tgt_layers=layers, length=length,
                                      offset=slot, devices=devices,
                                      weight_dtype=jnp.dtype(a.weights), mesh_shape=(data, model))
                runs = {"pallas": (prog.fn, prog.args, prog.kwargs), "xla": (*xla_program(prog), {})}
                for name in a.programs:
                    row = dict(pair=pair, slice=topo, mesh=f"{data}x{model}", length=length, slot=slot,
                               weights=a.weights,
                               **measure(name, *runs[name], prog.mesh, chip, prog.copy_bytes(), prog.flops(),
                                         len(devices)))
                    if "error" in row:
                        print(f"{pair:18s} {topo:10s} {length:>4d}@{slot:<4d} {name:7s} {row['error']}")
                    else:
                        print(f"{pair:18s} {topo:10s} {length:>4d}@{slot:<4d} {name:7s} {row['argument_mb']:8.1f} "
                              f"{row['temp_mb']:8.1f} {row['gflops']:7.1f} {row['accessed_mb']:8.1f} "
                              f"{row['copy_mb']:8.1f} {row['copy_us']:8.1f} {row['roofline_us']:8.1f} "
                              f"{row['vs_copy']:6.2f}")
                    sys.stdout.flush()
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
