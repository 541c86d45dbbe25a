"""Minimal safetensors reader/writer over numpy memory maps.

Reading maps the file and hands out zero-copy views, one tensor at a time, so loading a checkpoint never holds more
than the tensor being converted. bfloat16 is supported through ml_dtypes. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A .safetensors file that cannot be read."""


class SafetensorsFile:
    """Random access to the tensors of one .safetensors file."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        fix = f"re-download or re-save {path}"
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: file is {size} bytes, too short for a safetensors header; {fix}")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{path}: corrupt safetensors header (declares {n} header bytes in a "
                                       f"{size}-byte file); {fix}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{path}: corrupt safetensors header ({e}); {fix}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object); {fix}")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries = {}
        for name, e in header.items():
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{path}: corrupt safetensors header entry for {name!r}: {e!r}; {fix}") from None
            if end - begin != dtype.itemsize * int(np.prod(shape)) or self._data_start + end > size:
                raise SafetensorsError(f"{path}: tensor {name!r} ({e['dtype']} {list(shape)}) has inconsistent "
                                       f"offsets {begin}..{end} in a {size}-byte file (truncated?); {fix}")
            self._entries[name] = (dtype, shape, begin)
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if size else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of one tensor."""
        dtype, shape, begin = self._entries[name]
        start = self._data_start + begin
        count = int(np.prod(shape))
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=start).reshape(shape)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (numpy arrays) to `path` atomically (temp file + rename)."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in NAMES:
            raise SafetensorsError(f"cannot store {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)

