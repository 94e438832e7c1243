"""A fast GGUF header parser: metadata as Python values and tensor extents, data memory-mapped.

The `gguf` package's GGUFReader builds a numpy view per field part, which takes seconds for a
50k-token vocabulary; this reads the same header (GGUF v2/v3, little-endian) in milliseconds.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from quant.gguf_types import block_size

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 40


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout."""


@dataclass(frozen=True)
class TensorExtent:
    name: str
    type_id: int
    shape: tuple[int, ...]  # torch order: outermost first
    offset: int  # absolute offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, f: BinaryIO):
        self.f = f

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFFormatError("unexpected end of file in the header")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        n = self.scalar("<Q")
        if n > _MAX_COUNT:
            raise GGUFFormatError(f"implausible count {n}")
        return n

    def string(self) -> str:
        return self.read(self.count()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.count()
            if itype in _NUMPY:
                dtype = np.dtype(_NUMPY[itype])
                return np.frombuffer(self.read(n * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(itype) for _ in range(n)]
        raise GGUFFormatError(f"unknown metadata value type {vtype}")


def read_gguf(path: Path, types: dict[str, tuple[int, int | None]] | None = None
              ) -> tuple[dict[str, Any], list[TensorExtent], np.memmap]:
    """(metadata, tensor extents, the whole file memory-mapped as uint8); `types`, if given, receives
    each key's GGUF value type and, for arrays, the item type (to copy the metadata exactly)."""
    file_size = Path(path).stat().st_size
    with open(path, "rb") as f:
        cur = _Cursor(f)
        if cur.read(4) != b"GGUF":
            raise GGUFFormatError("bad magic")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.count(), cur.count()
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.scalar("<I")
            if types is not None:
                item = None
                if vtype == _ARRAY:
                    item = cur.scalar("<I")
                    f.seek(-4, 1)
                types[key] = (vtype, item)
            metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            block, type_size = block_size(type_id)
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has unknown type id {type_id}") from None
        numel = int(np.prod(dims)) if dims else 1
        if numel % block:
            raise GGUFFormatError(f"tensor {name}: {numel} elements is not a multiple of the block size {block}")
        extent = TensorExtent(name, type_id, tuple(int(d) for d in reversed(dims)), data_start + offset,
                              numel // block * type_size)
        if extent.offset + extent.nbytes > file_size:
            raise GGUFFormatError(f"tensor {name} extends past the end of the file")
        tensors.append(extent)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return metadata, tensors, data


def tensor_bytes(data: np.memmap, t: TensorExtent) -> np.ndarray:
    """The raw bytes of one tensor, shaped [rows, bytes per row] (a view of the mapped file)."""
    raw = data[t.offset:t.offset + t.nbytes]
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    return raw.reshape(rows, -1)
