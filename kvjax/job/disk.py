"""The disk under a run directory: what the stages will write (`estimate`, checked against the free space before the
first stage by `check_space`) and the one-line error for a write the disk refuses (`failed_write`, `describe`).

The estimate follows from the config and the models' config.json alone (no JAX, no weights read), so a planner can
call it before anything runs:

  calibrate   data/: the training text's tokens (up to data.max_train_tokens), the calibration and lambda-selection
              windows, the held-out windows (the given file, or up to data.max_heldout_tokens)             int32
  ridge       map_ridge/: per target layer, keys and values, the ridge (mu, w_in [Fx, r], w_out [r, Fy], bias) and
              a residual network of map.residual_rank (down [Fx, h], res_bias, up [h, Fy])                  float32
              Fx = the paired source layers (1 for depth pairing, K for topK) x the source's kv heads x head_dim,
              Fy = the target's kv heads x head_dim, r = map.rank or Fy
  residual    map/ (the map, with a context map's down_prev and a cross-position map's attention), and residual/:
              orbax checkpoints of (map, Adam's two moments of the trained leaves[, the EMA average]), two kept and
              one being written
  perhead     map_perhead/: per target layer, up to min(source layers, kv heads x perhead_topk) source layers in
  bridge      map_bridge/: the ridge's paired layers in; both a square w_out and a rank-1 residual
  evaluations eval/NAME.json: a record of numbers (EVAL_RECORD bounds it); audio adds its audio map
  report      metrics.json, report.md, gate.json, the charts (REPORT)

Arrays count at their size plus orbax's metadata (ORBAX_OVERHEAD per map, CHECKPOINT_OVERHEAD per checkpoint:
a few hundred kB of descriptors whatever the arrays' size); the estimate errs high (measured against what the
stages wrote: docs/architecture.md, "The run directory").
"""

from __future__ import annotations

import errno
import json
import os
import re

from kvjax.run.preflight import LaunchError
from kvjax.run.layout import stage_names

MB = 1 << 20
EVAL_RECORD = MB // 2  # an evaluation's eval/NAME.json: per-window and per-item numbers (kB on the shipped configs)
REPORT = 2 * MB  # metrics.json, report.md, gate.json and a dozen PNG charts (~50 kB each)
RUN_FILES = MB  # run.log, config.json, the stage markers, the lock
ORBAX_OVERHEAD = 128 << 10  # a saved map's metadata besides its arrays
CHECKPOINT_OVERHEAD = 512 << 10  # a training checkpoint's (sharding, array metadata, OCDBT manifests)
KEPT_CHECKPOINTS = 2 + 1  # kvjax.checkpointing.manager keeps 2; a third is written before the oldest goes


class WriteFailed(LaunchError):
    """A write into the run directory that the disk refused (full, read-only, not permitted); the message is one
    line naming the device, the path and the stage. kvjax.job.execute reports it as bad input (no traceback)."""


# ---- the estimate --------------------------------------------------------------------------------------------------

def _kv(path: str) -> tuple[int, int, int]:
    """(layers, kv heads, kv heads x head_dim) from a checkpoint's config.json."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    c = c.get("text_config", c)
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return int(c["num_hidden_layers"]), heads, heads * head_dim


def _linear(fx: int, fy: int, r: int, h: int, context: int = 0, heads: int = 0, dim: int = 0) -> tuple[int, int]:
    """(all floats, trained floats) of one LinearMap (kvjax.mapper.kvmap): the ridge part, then the residual."""
    ridge = fx + 1 + fx * r + r * fy + fy
    trained = fx * h + h + h * fy + context * fx * h + heads * (3 * fx * dim + dim * h)
    return ridge + trained, trained


def _map_floats(cfg, trained_map: bool = False, residual_rank: int | None = None) -> tuple[int, int, int]:
    """(all floats, trained floats, ridge floats w_in/w_out/bias) of the run's map: every target layer's key and value
    map; `trained_map`: as the residual stage trains it (a context map's down_prev, a cross-position map's
    attention)."""
    s_layers, _, s_width = _kv(cfg.source.path)
    t_layers, _, t_width = _kv(cfg.target.path)
    k = 1 if cfg.map.pairing == "depth" else min(int(cfg.map.pairing[3:]), s_layers)
    fx, fy = k * s_width, t_width
    r = fy if cfg.map.rank is None else min(cfg.map.rank, fy)
    h = cfg.map.residual_rank if residual_rank is None else residual_rank
    rc = cfg.residual
    total = trained = 0
    for kind in "kv":
        ctx = rc.context if trained_map and kind in rc.context_kinds else 0
        heads = rc.attention_heads if trained_map else 0
        a, t = _linear(fx, fy, r, h, ctx, heads, rc.attention_dim)
        total, trained = total + t_layers * a, trained + t_layers * t
    return total, trained, 2 * t_layers * (fx * r + r * fy + fy)


def _saved_map(floats: int) -> int:
    return int(4 * floats * 1.1) + ORBAX_OVERHEAD


def _peer(cfg, source_layers: int) -> int:
    """A peer map (per-head, bridge): `source_layers` source layers into each target layer, a square w_out and a
    rank-1 residual."""
    _, _, s_width = _kv(cfg.source.path)
    t_layers, _, t_width = _kv(cfg.target.path)
    fx, fy = source_layers * s_width, t_width
    return _saved_map(2 * t_layers * _linear(fx, fy, fy, 1)[0])


def estimate(cfg) -> dict[str, int]:
    """Bytes each stage of `cfg` writes into its run directory (an upper estimate; the module doc says how), by
    stage name in order, "run" for the files every run writes (log, config, markers)."""
    d, m, rc = cfg.data, cfg.map, cfg.residual
    heldout = (os.path.getsize(d.heldout_windows) if d.heldout_windows and os.path.isfile(d.heldout_windows)
               else 4 * d.max_heldout_tokens)
    out = {"run": RUN_FILES}
    for name in stage_names(cfg):
        if name == "calibrate":
            out[name] = 4 * (d.max_train_tokens + (m.calib_windows + m.select_windows) * m.window_len) + heldout + MB
        elif name == "ridge":
            out[name] = _saved_map(_map_floats(cfg)[0])
        elif name == "residual":
            total, trained, ridge = _map_floats(cfg, trained_map=True)
            state = total + 2 * trained + (2 * ridge if rc.train_ridge else 0) + (total if rc.ema > 0 else 0)
            out[name] = _saved_map(total) + KEPT_CHECKPOINTS * (int(4 * state * 1.1) + CHECKPOINT_OVERHEAD) + MB
        elif name == "perhead":
            # each head's top-k source layers: their union over a target layer's heads
            out[name] = _peer(cfg, min(_kv(cfg.source.path)[0], _kv(cfg.target.path)[1] * cfg.peers.perhead_topk))
        elif name == "bridge":
            out[name] = _peer(cfg, 1 if m.pairing == "depth" else int(m.pairing[3:]))
        elif name == "report":
            out[name] = REPORT
        else:
            out[name] = EVAL_RECORD
            ec = getattr(cfg.eval, name)
            if name == "audio":  # the audio map: the text map, its residual widened to map_rank
                width = max(m.residual_rank, getattr(ec, "map_rank", 0) or 0)
                out[name] += _saved_map(_map_floats(cfg, residual_rank=width)[0])
    return out


# ---- the disk ------------------------------------------------------------------------------------------------------

def _existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (a run directory not made yet lives on its parent's disk)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on the filesystem holding `path`."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def device(path: str) -> str:
    """The filesystem holding `path`, as `mount` names it: "SOURCE (MOUNT POINT)", e.g. "/dev/sda1 (/home")."""
    where = os.path.realpath(_existing(path))
    best = ("", where)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                point = fields[4].encode().decode("unicode_escape")  # "\040" is a space
                source = fields[fields.index("-") + 2]
                inside = where == point or where.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[1] if best[0] else ""):
                    best = (source, point)
    except (OSError, ValueError, IndexError):
        pass
    return f"{best[0]} ({best[1]})" if best[0] else best[1]


def check_space(cfg, stages: list[str], root: str, free: int | None = None) -> int:
    """Raise WriteFailed when the stages `stages` (those still to run) would write more than the free space on the
    disk of `root`; returns the bytes they need. `free`: the free bytes (default: measured)."""
    sizes = estimate(cfg)
    parts = {s: sizes[s] for s in ["run", *stages] if s in sizes}
    need = sum(parts.values())
    free = free_bytes(root) if free is None else free
    if need > free:
        most = sorted(parts.items(), key=lambda p: -p[1])
        big = ", ".join(f"{s} {mb(n)} MB" for s, n in most[:3]) + (", ..." if len(most) > 3 else "")
        raise WriteFailed(f"the run needs ~{mb(need)} MB in {root} ({big}), {mb(free, down=True)} MB free on "
                          f"{device(root)}: free some space or pass another --config.output_dir")
    return need


def mb(n: int, down: bool = False) -> int:
    return n // MB if down else -(-n // MB)


# ---- a write the disk refused --------------------------------------------------------------------------------------

REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_STRERROR = {os.strerror(e): e for e in REFUSED}


def failed_write(exc: BaseException, root: str = "") -> tuple[int, str] | None:
    """(errno, path) when `exc`, or an exception it wraps, is a write the disk refused: an OSError of REFUSED, or
    one that a library reports in its own type (orbax / TensorStore: ValueError("... Failed writing: \"PATH\": ...
    No space left on device [os_error_code='28']")). A permission error counts only for a path inside `root` (an
    unreadable checkpoint is not a write). None otherwise."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code, path = None, ""
        if isinstance(exc, OSError) and exc.errno in REFUSED:
            code, path = exc.errno, exc.filename or ""
            path = path.decode(errors="replace") if isinstance(path, bytes) else str(path)
        elif not isinstance(exc, OSError):
            text = str(exc)
            found = re.search(r"os_error_code='?(\d+)", text)
            code = int(found.group(1)) if found else next((e for s, e in _STRERROR.items() if s in text), None)
            quoted = re.search(r'Failed writing: "([^"]+)"', text) or re.search(r'"(/[^"]+)"', text)
            path = quoted.group(1) if quoted else ""
        if code in REFUSED:
            path = path or (_path_in_frames(exc, root) if root else "")
            if code in (errno.EACCES, errno.EPERM) and not (root and path and _inside(path, root)):
                return None
            return code, path
        exc = exc.__cause__ or exc.__context__
    return None


def _path_in_frames(exc: BaseException, root: str) -> str:
    """The file a write error without its file name was writing (a library writing through a file object: orbax's
    metadata through etils' Path.write_text), as the innermost path under `root` that the failing frames hold."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (str, os.PathLike)):
                try:
                    path = os.fspath(value)
                except TypeError:
                    continue
                if isinstance(path, str) and os.path.isabs(path) and _inside(path, root):
                    return path
    return ""


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def describe(code: int, path: str, stage: str, root: str) -> str:
    """The one line for a refused write of `path` (in the run directory `root`) during `stage`."""
    where = path or root
    dev = device(where)
    again = "run the same command again to resume (finished stages are kept)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left" if code == errno.ENOSPC else "disk quota exceeded"
        return (f"{what} on {dev} for {where} ({stage}): {mb(free_bytes(where), down=True)} MB free; free some "
                f"space and {again}")
    if code == errno.EROFS:
        return f"read-only filesystem {dev} for {where} ({stage}): make it writable and {again}"
    return f"no permission to write {where} ({stage}) on {dev}: make it writable and {again}"
