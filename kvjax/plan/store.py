"""Compiled programs' results kept on disk: a plan stopped halfway (a compile worker killed for memory, a closed
session) resumes where it stopped instead of compiling again what took minutes to hours.

A result is kept under a key of everything that decides it: the program (its library function, abstract arguments
and static ones: `Program.key`), the devices it was compiled for (kind, ids, coordinates and the mesh's shape), the
versions of jax and of the TPU compiler, and kvjax's own source (any edit to kvjax/ makes every key new, so a result
never outlives the code that produced it). One small JSON file per program, written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax

from kvjax.plan.program import Program

FIELDS = ("lower_seconds", "compile_seconds", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
          "code_bytes", "xla_flops", "xla_bytes", "error", "compiled")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """kvjax's source, jax's and libtpu's versions, as one digest."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    try:
        from importlib.metadata import version
        tpu = version("libtpu")
    except Exception:  # not installed: CPU plans only
        tpu = ""
    h.update(f"jax {jax.__version__} libtpu {tpu}".encode())
    return h.hexdigest()


def key(p: Program) -> str:
    devices = [(d.device_kind, d.id, tuple(getattr(d, "coords", ()) or ())) for d in p.mesh.devices.flat]
    text = repr((p.key(), devices, dict(p.mesh.shape), code_version()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def get(folder: str | None, p: Program) -> dict | None:
    """The kept result of `p` (Compiled's fields), or None."""
    if not folder:
        return None
    try:
        with open(os.path.join(folder, key(p) + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):  # none kept, or a torn file from a killed writer: compile again
        return None


def put(folder: str | None, p: Program, fields: dict) -> None:
    if not folder or not fields.get("compiled"):
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, key(p) + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump({k: fields[k] for k in FIELDS} | {"program": p.program, "name": p.name}, f)
    os.replace(path + ".tmp", path)
