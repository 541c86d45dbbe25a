"""The fit check the main job and the server run on their own devices before reading any weights: the plan's
programs for the devices at hand, judged by what their shapes alone hold (each model's weights as the mesh shards
them, the caches, the other inputs of the largest program of each stage), against the device's memory.

It compiles nothing (a few seconds, where compiling a 32B pair's programs takes minutes), so it is a lower bound:
it refuses what cannot fit whatever XLA does, and a config it passes may still be over once XLA's temporaries are
counted; `python -m kvjax.plan` compiles every program and says so (the refusal's message names it).
"""

from __future__ import annotations

from kvjax.plan import shapes
from kvjax.plan.hardware import MARGIN_NOTE, PlanError, Slice, device_slice

NEEDS = "python -m kvjax.plan --config={config} --topology=GEN:SHAPE (compiles every program) for the full check"


def stage_floor(b, progs) -> tuple[int, str]:
    """(bytes per device, program name): the weights both models take plus the largest program's other inputs."""
    weights = b.weights("source") + b.weights("target")
    best, name = 0, ""
    for p in progs:
        other = shapes.nbytes_per_device((p.args, p.kwargs)) - p.weight_bytes
        if other > best:
            best, name = other, p.name
    return weights + best, name


def job_problems(cfg, devices, memory_bytes: float) -> list[str]:
    """What the job's stages need beyond `memory_bytes` per device on `devices` (empty: nothing over), each naming
    the stage, its largest program, how many GB over and what to change."""
    from kvjax.plan import job
    sl = device_slice(devices, memory_bytes)
    b, stages = job.stage_programs(cfg, sl)
    out = []
    for name, progs in stages.items():
        if not progs:
            continue
        need, program = stage_floor(b, progs)
        if need > memory_bytes:
            out.append(f"stage {name}: {program} needs at least {need / 1e9:.2f} GB per device (weights "
                       f"{(b.weights('source') + b.weights('target')) / 1e9:.2f} GB + its inputs), "
                       f"{(need - memory_bytes) / 1e9:.2f} GB over the {memory_bytes / 1e9:.2f} GB of "
                       f"{sl.describe_short()}; {remedy(cfg, name)}")
    return out


def remedy(cfg, stage: str) -> str:
    """What to change when a stage does not fit."""
    mesh = f"more devices on the 'model' axis (--config.mesh.model; now {cfg.mesh.model or 'all'} x data " \
           f"{cfg.mesh.data})"
    fixes = {
        "ridge": "fewer calibration windows per batch (--config.map.batch_size) or shorter windows "
                 "(--config.map.window_len)",
        "residual": "a smaller batch (--config.residual.batch_size) or shorter windows (--config.residual.prefix_len, "
                    "cont_len)",
        "perhead": "--config.peers.perhead_topk=0 (its statistics span every source layer)",
        "bridge": "--config.peers.bridge_topk=0",
        "retrieval": "shorter lengths (--config.eval.retrieval.lengths) or --config.eval.retrieval.batch_size=1",
        "throughput": "shorter lengths (--config.eval.throughput.lengths)",
        "mc": "--config.eval.mc.batch_size smaller",
        "kl": "--config.eval.kl.batch_size smaller",
        "distances": "--config.eval.distances.batch_size smaller",
    }
    return f"use a larger slice, {mesh}, or " + fixes.get(stage, f"--config.eval.{stage}.enabled=false")


def check_job(cfg, devices=None, memory_bytes: float | None = None) -> None:
    """Raise PlanError listing every stage over the devices' memory (default: the local devices and what each
    reports, `memory_stats()["bytes_limit"]`; a CPU device reports none and is not checked unless
    `memory_bytes` is given)."""
    import jax
    devices = list(devices if devices is not None else jax.devices())
    memory_bytes = memory_bytes or device_memory(devices[0])
    if not memory_bytes:
        return
    if problems := job_problems(cfg, devices, memory_bytes):
        raise PlanError(f"the config does not fit these devices (nothing was loaded; {MARGIN_NOTE}):\n  - "
                        + "\n  - ".join(problems) + "\n" + NEEDS.format(config=cfg.name))


def device_memory(device) -> float:
    """The memory a device offers its programs (0 when it does not say: CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return 0.0
    return float(stats.get("bytes_limit", 0.0))


def as_slice(devices, memory_bytes: float) -> Slice:
    return device_slice(devices, memory_bytes)
