"""The bonsai checkpoint on disk: a directory with config.json, tokenizer files and safetensors.

Packed tensors are stored as `<hf name>.codes` and `<hf name>.scales` (float16 [N, K/G]); float
tensors under their own name. Every safetensors file's metadata says `format: bonsai`,
`format_version` and, in `bonsai.tensors`, a JSON map {hf name: {quant_type, group_size, shape}}
of the tensors it holds. A rotated model (`bonsai quantize --rotate`) also has `bonsai.rotation`:
{"residual": "randomized-hadamard", "seed": s, "down_proj_hadamard": b}; b > 0 means the down
projections hold W·H_b and the run time must apply I ⊗ H_b to their inputs, so such files say
format_version 2 (a version-1 reader refuses them instead of computing garbage); everything else
is version 1. Readers trust that metadata, never file names.

Writing goes tensor by tensor: each tensor's bytes are appended to a data file at once (never the
whole model in memory); a shard is closed when it passes `shard_bytes`, its header is written and the
data copied behind it. Everything is written into a hidden sibling directory renamed over the
output at the end, so an interrupted run leaves no output. Reading uses plain file reads (no
memory map), one tensor at a time. This module imports nothing else of bonsai.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.formats import QuantSpec, decode, encode
from quant.grids import dequantize

FORMAT_NAME = "bonsai"
FORMAT_VERSION = 2  # the newest this code reads; files without an online rotation are written as 1
SHARD_BYTES = 2 * 1024 ** 3
INDEX_FILE = "model.safetensors.index.json"
FLOAT_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "I32": torch.int32, "I64": torch.int64, "F64": torch.float64, "I16": torch.int16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_COPY_CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class CheckpointError(ValueError):
    """The files are not a readable bonsai checkpoint."""


@dataclass(frozen=True)
class TensorEntry:
    """What the metadata says of one tensor: its quant type ('tri'.. or a float type), group, shape."""
    quant_type: str
    group_size: int
    shape: tuple[int, ...]

    @property
    def is_float(self) -> bool:
        return self.quant_type in FLOAT_TYPES

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.quant_type, self.group_size)


class SafetensorsFile:
    """A safetensors file read with plain reads: header at open, one tensor per `read`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{self.path.name} is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 1 << 30):
                raise CheckpointError(f"{self.path.name} has an impossible header length {n}")
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path.name} has a corrupt header ({e})") from None
        self.data_start = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                begin, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(s) for s in info["shape"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path.name}: bad header entry for {name}") from None
            if end - begin != torch.Size(shape).numel() * dtype.itemsize or self.data_start + end > size:
                raise CheckpointError(f"{self.path.name}: tensor {name} does not fit the file (truncated?)")
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor; `rows` (start, stop): only those rows (outermost dimension) are read."""
        dtype, shape, begin, end = self.entries[name]
        if rows is not None:
            row_bytes = (end - begin) // max(shape[0], 1)
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            shape = (rows[1] - rows[0], *shape[1:])
        buf = bytearray(end - begin)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{self.path.name}: tensor {name} is truncated")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def is_checkpoint(directory: Path) -> bool:
    """True if the directory's safetensors metadata says format bonsai (reads one header)."""
    files = _shard_files(Path(directory)) if Path(directory).is_dir() else []
    if not files or not files[0].is_file():
        return False
    try:
        return SafetensorsFile(files[0]).metadata.get("format") == FORMAT_NAME
    except (CheckpointError, OSError):
        return False


class Checkpoint:
    """An opened bonsai checkpoint: config.json, the per-tensor map, and readers of its tensors."""

    def __init__(self, directory: Path):
        self.path = Path(directory)
        files = _shard_files(self.path)
        if not files:
            raise CheckpointError(f"{self.path} has no model.safetensors")
        self.entries: dict[str, TensorEntry] = {}
        self._where: dict[str, SafetensorsFile] = {}
        self.rotation: dict | None = None  # the bonsai.rotation metadata (see the module doc)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{self.path}: shard {file.name} listed in the index is missing")
            st = SafetensorsFile(file)
            meta = st.metadata
            if meta.get("format") != FORMAT_NAME:
                raise CheckpointError(f"{file.name} is not a bonsai checkpoint file (format {meta.get('format')!r})")
            if int(meta.get("format_version", "0")) > FORMAT_VERSION:
                raise CheckpointError(f"{file.name} has bonsai format version {meta['format_version']}, newer than "
                                      f"this bonsai reads ({FORMAT_VERSION}): upgrade bonsai")
            try:
                table = json.loads(meta["bonsai.tensors"])
                for name, e in table.items():
                    self.entries[name] = TensorEntry(str(e["quant_type"]), int(e["group_size"]),
                                                     tuple(int(s) for s in e["shape"]))
            except (KeyError, ValueError, TypeError) as e:
                raise CheckpointError(f"{file.name}: the bonsai.tensors metadata is missing or corrupt ({e})") from None
            for stored in st.entries:
                self._where[stored] = st
            if file == files[0]:
                self.rotation = _parse_rotation(meta.get("bonsai.rotation"), file.name)
        for name, entry in self.entries.items():
            needed = [name] if entry.is_float else [f"{name}.codes", f"{name}.scales"]
            if any(n not in self._where for n in needed):
                raise CheckpointError(f"{self.path}: tensor {name} is listed in the metadata but not stored")
            if not entry.is_float:
                QuantSpec(entry.quant_type, entry.group_size).check_shape(entry.shape)
        config_path = self.path / "config.json"
        try:
            self.config: dict = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} has no config.json") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_path} is not valid JSON ({e})") from None

    def stored_bytes(self, name: str) -> int:
        parts = [name] if self.entries[name].is_float else [f"{name}.codes", f"{name}.scales"]
        return sum(self._where[p].entries[p][3] - self._where[p].entries[p][2] for p in parts)

    def read_float(self, name: str) -> torch.Tensor:
        assert self.entries[name].is_float
        return self._where[name].read(name)

    def read_quantized(self, name: str) -> tuple[QuantSpec, torch.Tensor, torch.Tensor]:
        """(spec, codes int8 [N, K], scales float32 [N, K/G]) of a packed tensor."""
        entry = self.entries[name]
        codes = self._where[f"{name}.codes"].read(f"{name}.codes")
        scales = self._where[f"{name}.scales"].read(f"{name}.scales")
        spec = entry.spec
        c, s = decode(spec, codes, scales, (entry.shape[0], entry.shape[1]))
        return spec, c, s

    def read_dequantized(self, name: str) -> torch.Tensor:
        """Any tensor as float32 (packed ones dequantized)."""
        if self.entries[name].is_float:
            return self.read_float(name).float()
        spec, codes, scales = self.read_quantized(name)
        return dequantize(codes, scales, spec.group_size)


def _parse_rotation(text: str | None, where: str) -> dict | None:
    if text is None:
        return None
    try:
        rotation = json.loads(text)
        block = int(rotation["down_proj_hadamard"])
        ok = isinstance(rotation["residual"], str) and block >= 0 and block & (block - 1) == 0
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{where}: the bonsai.rotation metadata is corrupt ({text[:80]!r})")
    return rotation


class CheckpointWriter:
    """Writes a checkpoint tensor by tensor into a hidden temporary directory; `commit` renames it.

    Use as a context manager: leaving the block without `commit` (an error, Ctrl-C) removes it all.
    """

    def __init__(self, out_dir: Path, force: bool = False, shard_bytes: int = SHARD_BYTES,
                 rotation: dict | None = None):
        self.out = Path(out_dir)
        self.rotation = rotation  # the bonsai.rotation metadata, or None
        if self.out.exists() and not force:
            raise FileExistsError(f"{self.out} exists")
        self.force, self.shard_bytes = force, shard_bytes
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        self._shards: list[Path] = []
        self._names_by_shard: list[list[str]] = []
        self._finished = False
        self._open_shard()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tmp.exists():
            self.abort()

    def abort(self) -> None:
        self._data.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _open_shard(self) -> None:
        self._data_path = self.tmp / f".shard-{len(self._shards)}.data"
        self._data = open(self._data_path, "wb")
        self._header: dict[str, dict] = {}
        self._table: dict[str, dict] = {}
        self._size = 0

    @property
    def format_version(self) -> int:
        return 2 if self.rotation and self.rotation.get("down_proj_hadamard") else 1

    def add_file(self, name: str, data: bytes) -> None:
        (self.tmp / name).write_bytes(data)

    def copy_file(self, name: str, source: Path) -> None:
        shutil.copyfile(source, self.tmp / name)

    def write_quantized(self, name: str, spec: QuantSpec, codes: torch.Tensor, scales: torch.Tensor) -> int:
        """Store codes int8 [N, K] and scales [N, K/G]; returns the bytes written."""
        stored_codes, stored_scales = encode(spec, codes, scales)
        entry = {"quant_type": spec.quant_type, "group_size": spec.group_size, "shape": list(codes.shape)}
        return self._append(name, entry, [(f"{name}.codes", stored_codes), (f"{name}.scales", stored_scales)])

    def write_float(self, name: str, tensor: torch.Tensor, float_type: str) -> int:
        """Store a float tensor under its own name as 'bf16', 'f16' or 'f32'; returns the bytes written."""
        t = tensor.to(FLOAT_TYPES[float_type]).contiguous()
        entry = {"quant_type": float_type, "group_size": 0, "shape": list(t.shape)}
        return self._append(name, entry, [(name, t)])

    def _append(self, name: str, entry: dict, tensors: list[tuple[str, torch.Tensor]]) -> int:
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        if self._size and self._size + nbytes > self.shard_bytes:
            self._close_shard()
            self._open_shard()
        for stored_name, t in tensors:
            data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # the tensor's bytes, not a copy
            self._header[stored_name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                                         "data_offsets": [self._size, self._size + data.size]}
            self._data.write(memoryview(data))
            self._size += data.size
        self._table[name] = entry
        return nbytes

    def _close_shard(self) -> None:
        self._data.close()
        meta = {"format": FORMAT_NAME, "format_version": str(self.format_version),
                "bonsai.tensors": json.dumps(self._table, separators=(",", ":"))}
        if self.rotation is not None:
            meta["bonsai.rotation"] = json.dumps(self.rotation, separators=(",", ":"))
        header = json.dumps({"__metadata__": meta, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        shard = self.tmp / f".shard-{len(self._shards)}.safetensors"
        with open(shard, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, _COPY_CHUNK)
        self._data_path.unlink()
        self._shards.append(shard)
        self._names_by_shard.append(list(self._header))

    def finish(self) -> Path:
        """Close the last shard, name the shards and write the index if sharded; returns the still
        hidden directory (readable with Checkpoint) that `commit` renames."""
        if self._finished:
            return self.tmp
        self._close_shard()
        self._finished = True
        n = len(self._shards)
        if n == 1:
            os.replace(self._shards[0], self.tmp / "model.safetensors")
            return self.tmp
        weight_map, total = {}, 0
        for i, (shard, names) in enumerate(zip(self._shards, self._names_by_shard)):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += shard.stat().st_size
            os.replace(shard, self.tmp / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"format": FORMAT_NAME, "format_version": self.format_version, "total_size": total},
                 "weight_map": weight_map}
        (self.tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return self.tmp

    def commit(self) -> Path:
        """Finish and rename the directory into place (replacing the output with force)."""
        self.finish()
        self._rename_into_place()
        return self.out

    def _rename_into_place(self) -> None:
        os.chmod(self.tmp, 0o777 & ~_umask())  # mkdtemp made it private
        if self.out.exists() or self.out.is_symlink():
            if not self.force:
                raise FileExistsError(f"{self.out} exists")
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, old / "replaced")
            os.replace(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.out)
