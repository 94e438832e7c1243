"""A fast GGUF header parser: metadata as Python values and tensor extents, data memory-mapped.

The `gguf` package's GGUFReader builds a numpy view per field part, which takes seconds for a
50k-token vocabulary; this reads the same header (GGUF v2/v3, little-endian) in milliseconds.

Every length and count in the header is checked against the bytes left in the file before
anything is read or allocated for it (a hostile length is an error, never a MemoryError), and the
tensor infos against GGML's rules (at most 4 dimensions, none zero, rows a whole number of blocks,
offsets aligned, nothing past the end) and `general.alignment` against GGUF's (a power of two).
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from quant.gguf_types import block_size, type_name

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays (llama.cpp reads none)
_MAX_ALIGNMENT = 1 << 20


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout."""


class UnknownTypeError(GGUFFormatError):
    """A tensor of a type id this version does not know (its size cannot even be computed)."""


@dataclass(frozen=True)
class TensorExtent:
    name: str
    type_id: int
    shape: tuple[int, ...]  # torch order: outermost first
    offset: int  # absolute offset in the file
    nbytes: int


class _Cursor:
    """Reads the header, never past the file's end: every length is checked against what is left."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def left(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.left():
            raise GGUFFormatError(f"a header field needs {n} bytes but the file has {self.left()} left "
                                  "(truncated, or a corrupt length)")
        return self.f.read(n)

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def count(self, what: str, item_bytes: int) -> int:
        """A count of items of at least `item_bytes` each, which must fit in the rest of the file."""
        n = self.scalar("<Q")
        if n * item_bytes > self.left():
            raise GGUFFormatError(f"{what} is {n}, more than the {self.left()} bytes left in the file can hold")
        return n

    def string(self, what: str = "a string's length") -> str:
        return self.read(self.count(what, 1)).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(f"the length of {key}")
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise GGUFFormatError(f"{key} nests arrays more than {_MAX_NESTING} deep")
            itype = self.scalar("<I")
            if itype in _NUMPY:
                dtype = np.dtype(_NUMPY[itype])
                n = self.count(f"the item count of {key}", dtype.itemsize)
                return np.frombuffer(self.read(n * dtype.itemsize), dtype=dtype).tolist()
            n = self.count(f"the item count of {key}", 8 if itype == _STRING else 12)
            return [self.value(itype, key, depth + 1) for _ in range(n)]
        raise GGUFFormatError(f"{key} has an unknown metadata value type {vtype}")


def read_gguf(path: Path, types: dict[str, tuple[int, int | None]] | None = None
              ) -> tuple[dict[str, Any], list[TensorExtent], np.memmap]:
    """(metadata, tensor extents, the whole file memory-mapped as uint8); `types`, if given, receives
    each key's GGUF value type and, for arrays, the item type (to copy the metadata exactly)."""
    file_size = Path(path).stat().st_size
    with open(path, "rb") as f:
        cur = _Cursor(f, file_size)
        if cur.read(4) != b"GGUF":
            raise GGUFFormatError("bad magic")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        n_tensors = cur.count("the tensor count", 24)  # name length, dimension count, type, offset
        n_kv = cur.count("the metadata key count", 13)  # key length, value type, one byte
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key's length")
            if key in metadata:
                raise GGUFFormatError(f"the metadata key {key} appears twice")
            vtype = cur.scalar("<I")
            if types is not None:
                item = None
                if vtype == _ARRAY:
                    item = cur.scalar("<I")
                    f.seek(-4, 1)
                types[key] = (vtype, item)
            metadata[key] = cur.value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name's length")
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions; GGUF allows 1 to {_MAX_DIMS}")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = metadata.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment <= _MAX_ALIGNMENT \
                or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment is {alignment!r}; it must be a power of two "
                                  f"up to {_MAX_ALIGNMENT}")
        data_start = -(-f.tell() // alignment) * alignment
    tensors, names = [], set()
    for name, dims, type_id, offset in infos:
        tensors.append(_extent(name, dims, type_id, offset, data_start, alignment, file_size))
        if name in names:
            raise GGUFFormatError(f"tensor {name} appears twice")
        names.add(name)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return metadata, tensors, data


def _extent(name: str, dims: list[int], type_id: int, offset: int, data_start: int, alignment: int,
            file_size: int) -> TensorExtent:
    """One tensor info checked against GGML's rules and the file's size."""
    try:
        block, type_size = block_size(type_id)
    except (ValueError, KeyError):
        raise UnknownTypeError(f"tensor {name} has unknown type id {type_id}") from None
    if any(d == 0 for d in dims):
        raise GGUFFormatError(f"tensor {name} has a zero dimension {dims}")
    numel = math.prod(dims)
    if numel >= 1 << 63:
        raise GGUFFormatError(f"tensor {name}: its dimensions {dims} overflow")
    if dims[0] % block:
        raise GGUFFormatError(f"tensor {name}: its rows of {dims[0]} elements are not a whole number of "
                              f"{type_name(type_id)} blocks of {block}")
    if offset % alignment:
        raise GGUFFormatError(f"tensor {name}: its offset {offset} is not a multiple of general.alignment "
                              f"{alignment}")
    extent = TensorExtent(name, type_id, tuple(int(d) for d in reversed(dims)), data_start + offset,
                          numel // block * type_size)
    if extent.offset + extent.nbytes > file_size:
        raise GGUFFormatError(f"tensor {name} extends past the end of the file")
    return extent


def tensor_bytes(data: np.memmap, t: TensorExtent) -> np.ndarray:
    """The raw bytes of one tensor, shaped [rows, bytes per row] (a view of the mapped file)."""
    raw = data[t.offset:t.offset + t.nbytes]
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    return raw.reshape(rows, -1)


def release_pages(data: np.memmap, t: TensorExtent) -> None:
    """Drop one tensor's pages of the mapped file from this process's resident set once it is decoded (they
    stay in the page cache; a later read faults them in again): a reader that goes tensor by tensor, as
    `bonsai quantize` does, then holds one tensor of the file resident, not every page it has read (0.5B
    GGUF, every tensor read: RSS +463 MiB without, docs/quality.md)."""
    mapped = getattr(data, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return  # not a file mapping numpy made, or no madvise here: pages stay until the mapping closes
    start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
    stop = min(-(-(t.offset + t.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE, len(mapped))
    if stop > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, stop - start)
