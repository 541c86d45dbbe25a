"""The .safetensors boundary: files are read and written by the `safetensors` package; this module turns the
package's terse errors into ones that name the file and the fix, and makes writes atomic.

Reading uses `safe_open(path, framework="numpy")`. Opening parses the header and checks it against the file size
(so a truncated or corrupt file fails here, before any tensor is read); each tensor is then read from a memory map
only when asked for, so a checkpoint streams one tensor at a time. numpy rather than flax: a host array can be
converted to our layout and dtype and then placed with any sharding, where the flax path would first put every
tensor whole on the default device. bfloat16 arrives as ml_dtypes.bfloat16 (safetensors >= 0.8).
"""

from __future__ import annotations

import os

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file as _save_file


class SafetensorsError(ValueError):
    """A .safetensors file that cannot be read or written; the message names the file and the fix."""


# The package's error text (safetensors 0.8) -> what it means for the user. Anything else is reported verbatim.
_MEANINGS = (
    ("header too small", "too short for a safetensors header"),
    ("header too large", "corrupt safetensors header (it declares a header longer than a file may have)"),
    ("invalid json", "corrupt safetensors header (not valid JSON)"),
    ("invalid header length", "the file ends inside its header: it is truncated"),
    ("invalid header", "corrupt safetensors header"),
    ("incomplete metadata", "the tensor data does not match the header: the file is truncated (or has bytes "
                            "appended)"),
    ("invalid offset", "corrupt safetensors header (tensor offsets overlap or leave gaps)"),
)


def _read_error(path: str, e: Exception) -> SafetensorsError:
    text = str(e)
    meaning = next((m for key, m in _MEANINGS if key in text.lower()), "cannot be read as safetensors")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return SafetensorsError(f"{path} ({size} bytes): {meaning} [safetensors: {text}]; re-download or re-save it")


class SafetensorsFile:
    """The tensors of one .safetensors file, read lazily: names, shapes, and one tensor at a time."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            self._file = safe_open(self.path, framework="numpy")
        except SafetensorError as e:
            raise _read_error(self.path, e) from None
        self.metadata = self._file.metadata() or {}

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the header alone."""
        return tuple(self._file.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        try:
            return self._file.get_tensor(name)
        except SafetensorError as e:  # the file changed on disk after it was opened
            raise _read_error(self.path, e) from None


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays to `path` atomically (temp file + rename: a reader never sees half a file)."""
    # the package reads each array's raw buffer, so a strided view (e.g. a transpose) must be made contiguous first
    dense = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    tmp = path + ".tmp"
    try:
        _save_file(dense, tmp, metadata={str(k): str(v) for k, v in (metadata or {}).items()} or None)
    except (SafetensorError, ValueError, TypeError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SafetensorsError(f"cannot write {path}: {e} (dtypes: "
                               f"{sorted({str(a.dtype) for a in dense.values()})})") from None
    os.replace(tmp, path)
