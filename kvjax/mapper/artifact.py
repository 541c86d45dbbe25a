"""Map artifacts on disk: an orbax checkpoint of the arrays plus manifest.json saying what the map belongs to.

The arrays are written as host (numpy) arrays and read back as host arrays, then placed: a checkpoint records no
device topology, so a map fitted on any mesh or number of processes loads on any other, one device included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from kvjax.mapper.kvmap import KVMap, LinearMap, MapSpec
from kvjax.models.family import DecoderConfig
from kvjax.models.rope import Rope

MANIFEST = "manifest.json"
ARRAYS = "arrays"
FORMAT = "kvjax-map-v2"  # v2: each model's RoPE description (kvjax.models.rope.Rope) instead of its theta
READS = ("kvjax-map-v1", FORMAT)  # v1 maps stored source_theta / target_theta: plain RoPE


def _shapes(m: LinearMap) -> dict:
    shapes = {"fx": m.w_in.shape[0], "r": m.w_in.shape[1], "fy": m.w_out.shape[1], "h": m.down.shape[1]}
    if m.down_prev is not None:  # a context map (absent: maps saved before context maps existed read as before)
        shapes["context"] = m.down_prev.shape[0]
    if m.att_q is not None:  # a cross-position map: its attention's heads and width
        shapes["heads"], shapes["att_dim"] = m.att_q.shape[0], m.att_q.shape[2]
    return shapes


def _fields(m: LinearMap) -> dict:
    """A LinearMap's arrays by field name; fields it lacks (None: `down_prev` of a map that reads each position
    alone) are not written, so such a map is stored exactly as before context maps existed."""
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if getattr(m, f.name) is not None}


def _host_copy(a) -> np.ndarray:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        if not a.sharding.is_fully_replicated:
            raise ValueError(f"save_map in a multi-process run needs a replicated map, got an array sharded as "
                             f"{a.sharding.spec}; keep the map's logical axes replicated (kvjax.sharding.RULES)")
        return np.asarray(a.addressable_data(0))
    return np.asarray(a)


def _this_process_only() -> ocp.options.MultiprocessingOptions:
    """Orbax options for I/O done by this process alone: no barriers with processes that do not take part (a map is
    saved by process 0 only, and may be loaded by any subset of processes)."""
    if jax.process_count() == 1:
        return ocp.options.MultiprocessingOptions()
    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})


def save_map(path: str, kvmap: KVMap, info: dict | None = None) -> None:
    """Write the map to `path` (a directory; replaced atomically). `info` (JSON-able) goes into the manifest: model
    names, tokenizer hash, calibration data hash and token count, fit metrics. In a multi-process run every process
    may call it with a replicated map: process 0 writes alone, without barriers, and the others return at once
    (synchronize before another process reads the map)."""
    if jax.process_index() != 0:
        return
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    kvmap = jax.tree.map(_host_copy, kvmap)  # host arrays: the checkpoint records no mesh (see the module doc)
    ckptr = ocp.StandardCheckpointer(multiprocessing_options=_this_process_only())
    ckptr.save(os.path.join(tmp, ARRAYS), {"keys": tuple(map(_fields, kvmap.keys)),
                                           "values": tuple(map(_fields, kvmap.values))})
    ckptr.wait_until_finished()
    # orbax's finalisation marker names the temporary path it wrote to (machine-specific, stale after the rename
    # below); the rename is what makes this map whole, and restoring does not read the marker
    marker = os.path.join(tmp, ARRAYS, "commit_success.txt")
    if os.path.exists(marker):
        os.remove(marker)
    manifest = {"format": FORMAT, "spec": dataclasses.asdict(kvmap.spec),
                "layers": [_shapes(m) for m in kvmap.keys], "value_layers": [_shapes(m) for m in kvmap.values],
                "info": info or {}}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _abstract(shapes: dict) -> dict:
    """A LinearMap's arrays as a field -> array dict (restored as numpy: see _restore). A dict, not a LinearMap: orbax
    would look for a saved entry under each of its fields, a map's absent `down_prev` (None) included."""
    s = lambda *dims: np.zeros(dims, np.float32)  # noqa: E731
    fields = dict(mu=s(shapes["fx"]), scale=s(), w_in=s(shapes["fx"], shapes["r"]), w_out=s(shapes["r"], shapes["fy"]),
                  bias=s(shapes["fy"]), down=s(shapes["fx"], shapes["h"]), res_bias=s(shapes["h"]),
                  up=s(shapes["h"], shapes["fy"]))
    if shapes.get("context"):
        fields["down_prev"] = s(shapes["context"], shapes["fx"], shapes["h"])
    if shapes.get("heads"):
        a, d = shapes["heads"], shapes["att_dim"]
        fields.update(att_q=s(a, shapes["fx"], d), att_k=s(a, shapes["fx"], d), att_v=s(a, shapes["fx"], d),
                      att_o=s(a, d, shapes["h"]))
    return fields


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise FileNotFoundError(f"{path} is not a kvjax map (no {MANIFEST}); fit one with kvjax.fit_map and save it "
                                "with kvjax.save_map")
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") not in READS:
        raise ValueError(f"{mpath}: unknown map format {manifest.get('format')!r} (this kvjax reads {list(READS)})")
    return manifest


def _restore(path: str, like: dict) -> dict:
    """The checkpoint's arrays as numpy, whatever mesh or process count wrote them: restoring into jax arrays
    without target shardings makes orbax reuse the saved ones, which fails on another topology."""
    restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray), like)
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=_this_process_only())
    with ocp.Checkpointer(handler, multiprocessing_options=_this_process_only()) as ckptr:
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(item=like, restore_args=restore_args))


def load_map(path: str, source: DecoderConfig | None = None, target: DecoderConfig | None = None,
             sharding: jax.sharding.Sharding | None = None) -> KVMap:
    """Load a map saved on any mesh or process count; with `source`/`target` configs, refuse (clearly) a map fitted
    for other models. Every array goes to `sharding` (e.g. NamedSharding(mesh, P()) to replicate it over a mesh;
    default: this process's first device)."""
    manifest = read_manifest(path)
    spec_d = manifest["spec"]
    spec_d["pairing"] = tuple(tuple(p) for p in spec_d["pairing"])
    spec_d["source_kv"], spec_d["target_kv"] = tuple(spec_d["source_kv"]), tuple(spec_d["target_kv"])
    for role in ("source", "target"):  # a v1 manifest's theta is the plain RoPE of that theta
        spec_d[f"{role}_rope"] = Rope.from_json(spec_d.pop(f"{role}_rope", None) or spec_d.pop(f"{role}_theta"))
    spec = MapSpec(**spec_d)
    for cfg, want, role in ((source, spec.source_fingerprint, "source"), (target, spec.target_fingerprint, "target")):
        if cfg is not None and cfg.fingerprint() != want:
            raise ValueError(f"map {path} was fitted for a {role} model with config hash {want}, not this one "
                             f"({cfg.fingerprint()}); fit a map for these models or load the matching map")
    abstract = {"keys": tuple(_abstract(s) for s in manifest["layers"]),
                "values": tuple(_abstract(s) for s in manifest["value_layers"])}
    arrays = _restore(os.path.join(os.path.abspath(path), ARRAYS), abstract)
    if sharding is None:
        arrays = jax.device_put(arrays, jax.local_devices()[0])
    else:  # every process holds the whole host array: each fills in its own devices' parts (any process count)
        arrays = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx]), arrays)
    return KVMap(keys=tuple(LinearMap(**m) for m in arrays["keys"]),
                 values=tuple(LinearMap(**m) for m in arrays["values"]), spec=spec)
