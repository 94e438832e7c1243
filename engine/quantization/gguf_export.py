"""Export a bonsai checkpoint as a GGUF that llama.cpp reads, saying what the conversion loses.

Every tensor goes to the llama.cpp type that holds it exactly where one exists
(quant.gguf_codec.export_type): ternary g64/g128 → Q2_0 (each group scale written once per 64-block),
g256 → TQ2_0 (TQ1_0 for tri-dense), 1-bit g128 → Q1_0, int4 → Q4_0, int8 → Q8_0, and any grid at a
group that is a multiple of 32 → Q4_0 / Q8_0; bf16 matrices → BF16, f32 → F32, vectors F32. Where none
does (a group size that is not a multiple of 32, or of a type's block), the tensor is lossy (scales
merged into larger blocks, or F16 of the weights): `export_gguf` refuses unless allow_lossy, naming the
tensors and their relative weight error. Llama q/k rows get llama.cpp's rotary permutation. Qwen3.5 /
3.6 hybrids are written as llama.cpp's `qwen35` (engine.quantization.gguf_export_qwen35: metadata, names
and the converter's value transforms and V-head reorder; a packed matrix whose scale groups the reorder
would split is written as F16, lossy). Tensors are written one at a time.
"""
from __future__ import annotations

import math
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from engine.quantization import gguf_export_qwen35 as q35
from engine.sources import gguf_qwen35
from engine.sources.checkpoint_file import canonical_name
from engine.errors import BonsaiError
from engine.sources.gguf_file import GGUFFile, gguf_name, permute_rotary
from engine.sources.gguf_metadata import add_architecture, add_tokenizer_from_hf, copy_metadata
from engine.sources.model_config import ModelConfig
from quant import gguf_codec, gguf_types
from quant.checkpoint import Checkpoint, TensorEntry
from quant.formats import rounding_error
from quant.grids import dequantize
from quant.recipe import layer_kind


@dataclass
class GGUFTensorExport:
    name: str  # GGUF name
    source_type: str  # the checkpoint's quant type ("tri", "bf16", ...)
    gguf_type: str
    err_sq: float = 0.0
    ref_sq: float = 0.0

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq > 0 else 0.0


@dataclass
class GGUFExportReport:
    path: Path
    tensors: list[GGUFTensorExport] = field(default_factory=list)

    @property
    def relative_error(self) -> float:
        """Relative Frobenius error of all exported weights against the checkpoint's."""
        ref = sum(t.ref_sq for t in self.tensors)
        return math.sqrt(sum(t.err_sq for t in self.tensors) / ref) if ref > 0 else 0.0

    @property
    def lossless(self) -> bool:
        return all(t.err_sq == 0 for t in self.tensors)

    def as_dict(self) -> dict:
        conversions: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "err_sq": 0.0, "ref_sq": 0.0})
        for t in self.tensors:
            c = conversions[f"{t.source_type} -> {t.gguf_type}"]
            c["tensors"] += 1
            c["err_sq"] += t.err_sq
            c["ref_sq"] += t.ref_sq
        return {"path": str(self.path), "relative_error": self.relative_error, "lossless": self.lossless,
                "conversions": {k: {"tensors": v["tensors"],
                                    "relative_error": math.sqrt(v["err_sq"] / v["ref_sq"]) if v["ref_sq"] else 0.0}
                                for k, v in conversions.items()}}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _row_permutation(name: str, config: ModelConfig) -> int | None:
    """Heads to permute q/k rows by (llama), else None."""
    if config.architecture != "llama":
        return None
    return {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(layer_kind(name).rsplit(".", 1)[-1])


def _stored_name(name: str, config: ModelConfig) -> str:
    """The GGUF name of a checkpoint tensor (qwen35's names for a hybrid)."""
    canon = canonical_name(name)
    return gguf_qwen35.gguf_name(canon) if config.hybrid is not None else gguf_name(canon)


def packed_export_type(name: str, quant_type: str, k: int, group: int, config: ModelConfig | None
                       ) -> tuple[int, str | None]:
    """(GGUF type of a packed matrix, why it is lossy or None): F16 where a hybrid's V-head reorder would
    split its scale groups (with `config`), else quant.gguf_codec.export_type's."""
    split = q35.reorder_lossy(canonical_name(name), quant_type, group, config) if config is not None else None
    if split:
        return int(T.F16), split
    type_id, exact = gguf_codec.export_type(quant_type, k, group)
    return type_id, None if exact else f"{quant_type} g{group} → {gguf_types.type_name(type_id)}"


def lossy_tensors(checkpoint: Checkpoint, config: ModelConfig | None = None) -> list[tuple[str, str]]:
    """(name, 'tri g48 → Q4_0') of every quantized tensor no llama.cpp type holds exactly (with `config`,
    also a hybrid's whose scale groups the V-head reorder splits)."""
    out = []
    for name, entry in checkpoint.entries.items():
        if canonical_name(name) is None or entry.is_float:
            continue
        _, how = packed_export_type(name, entry.quant_type, entry.shape[1], entry.group_size, config)
        if how is not None:
            out.append((name, how))
    return out


def lossy_message(lossy: list[tuple[str, str]], error: float | None = None) -> str:
    name, how = lossy[0]
    cost = f", relative weight error {error:.4f}" if error is not None else ""
    heads = ", for a DeltaNet out_proj also one dividing linear_value_head_dim" if any(
        q35.REORDER in h for _, h in lossy) else ""
    return (f"--gguf: {len(lossy)} tensors have no llama.cpp type that holds their codes exactly, e.g. {name} "
            f"({how}{cost}): quantize with a group size that is a multiple of 64 (ternary), 128 (1-bit) or 32 "
            f"(int4/int8){heads}, or pass --allow-lossy-gguf")


def export_gguf(checkpoint: Checkpoint, out: Path, config: ModelConfig, *, source_gguf: GGUFFile | None,
                tokenizer_dir: Path, allow_lossy: bool = False) -> GGUFExportReport:
    """Write `out` (through a temporary file renamed at the end) from an opened checkpoint; refuse
    (BonsaiError) a lossy export unless allow_lossy."""
    if checkpoint.rotation and checkpoint.rotation.get("down_proj_hadamard"):
        raise BonsaiError("--gguf: llama.cpp cannot apply the online Hadamard on down_proj of this rotated "
                          "checkpoint: quantize with --rotate --no-online-hadamard to export it")
    lossy = lossy_tensors(checkpoint, config)
    if lossy and not allow_lossy:
        raise BonsaiError(lossy_message(lossy, _export_tensor(checkpoint, lossy[0][0], config)[1].relative_error))
    out = Path(out)
    report = GGUFExportReport(path=out)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(str(tmp), config.architecture)
        hybrid = config.hybrid is not None
        mtp_layers, mtp = q35.mtp_entries(checkpoint.entries, config) if hybrid else (0, [])
        if source_gguf is not None:
            copy_metadata(writer, source_gguf, q35.NOT_COPIED if hybrid else frozenset())
            if hybrid:
                q35.add_block_count(writer, config, mtp_layers)
        else:
            if hybrid:
                q35.add_architecture(writer, config, checkpoint.config, mtp_layers)
            else:
                add_architecture(writer, config)
            add_tokenizer_from_hf(writer, tokenizer_dir, config.vocab_size)
        writer.add_quantization_version(2)
        names = [n for n in checkpoint.entries if canonical_name(n) is not None]
        for name in names:  # the header first, from the metadata alone: then tensors stream one at a time
            entry = checkpoint.entries[name]
            type_id, shape, dtype, nbytes = _export_layout(name, entry, config)
            if type_id == gguf_codec.Q2_0_ID:  # not in the gguf package's enum (0.19): id and element shape as they are
                writer.add_tensor_info(_stored_name(name, config), entry.shape, np.float32, nbytes, raw_dtype=type_id)
                continue
            writer.add_tensor_info(_stored_name(name, config), shape, dtype, nbytes,
                                   raw_dtype=T(type_id) if dtype == np.uint8 else None)
        for name, stored, canon in mtp:  # a hybrid's MTP head (bfloat16 entries: F32 norms, BF16 matrices)
            shape = tuple(checkpoint.entries[name].shape)
            if len(shape) < 2:
                writer.add_tensor_info(stored, shape, np.float32, 4 * int(np.prod(shape)))
            else:
                writer.add_tensor_info(stored, (shape[0], 2 * int(np.prod(shape[1:]))), np.uint8,
                                       2 * int(np.prod(shape)), raw_dtype=T.BF16)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in names:
            data, record = _export_tensor(checkpoint, name, config)
            record.name = _stored_name(name, config)
            writer.write_tensor_data(data)
            report.tensors.append(record)
        for name, stored, canon in mtp:
            w = q35.mtp_stored(canon, checkpoint.read_float(name), config)
            if w.dim() < 2:
                writer.write_tensor_data(w.float().numpy())
                report.tensors.append(GGUFTensorExport(stored, "bf16", "F32"))
            else:
                raw = w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
                writer.write_tensor_data(raw.reshape(w.shape[0], -1))
                report.tensors.append(GGUFTensorExport(stored, "bf16", "BF16"))
        writer.close()
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp made it private
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return report


def _export_layout(name: str, entry: TensorEntry, config: ModelConfig) -> tuple[int, tuple[int, ...], type, int]:
    """(GGUF type, shape as written, numpy dtype, bytes) of a checkpoint tensor's export."""
    numel = int(np.prod(entry.shape))
    if entry.is_float:
        shape = q35.stored_shape(canonical_name(name), entry.shape, config)
        if len(shape) < 2 or entry.quant_type == "f32" or q35.forces_f32(canonical_name(name), config):
            return int(T.F32), shape, np.float32, 4 * numel
        if entry.quant_type == "bf16":  # raw bfloat16 bytes: numpy has no bfloat16
            return int(T.BF16), (shape[0], 2 * int(np.prod(shape[1:]))), np.uint8, 2 * numel
        return int(T.F16), shape, np.float16, 2 * numel
    rows, k = entry.shape
    type_id, _ = packed_export_type(name, entry.quant_type, k, entry.group_size, config)
    if type_id == T.F16:
        return type_id, entry.shape, np.float16, 2 * numel
    block, size = gguf_codec.BLOCKS[type_id]
    return type_id, (rows, k // block * size), np.uint8, rows * (k // block) * size


def _export_tensor(checkpoint: Checkpoint, name: str, config: ModelConfig) -> tuple[np.ndarray, GGUFTensorExport]:
    entry, canon = checkpoint.entries[name], canonical_name(name)
    heads = _row_permutation(name, config) if len(entry.shape) == 2 else None
    hybrid = config.hybrid is not None
    if entry.is_float:
        w = checkpoint.read_float(name)
        if hybrid:  # the converter's transforms (exact but for the float32 rounding of norm + 1 and -exp)
            w = gguf_qwen35.to_stored(canon, w.float() if q35.forces_f32(canon, config) else w, config)
        if w.dim() < 2 or entry.quant_type == "f32" or q35.forces_f32(canon, config):
            w = w.float() if heads is None else permute_rotary(w.float(), heads)
            return w.numpy(), GGUFTensorExport(name, entry.quant_type, "F32")
        if entry.quant_type == "bf16":
            w = w if heads is None else permute_rotary(w, heads)
            raw = w.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(w.shape[0], -1)
            return raw, GGUFTensorExport(name, entry.quant_type, "BF16")
        half = w.to(torch.float16)
        if not torch.isfinite(half).all():
            raise BonsaiError(f"--gguf: tensor {name} has values beyond float16's range; it cannot be exported as F16")
        err, ref = rounding_error(w, torch.float16)
        if heads is not None:
            half = permute_rotary(half, heads)
        return half.numpy(), GGUFTensorExport(name, entry.quant_type, "F16", err, ref)
    spec, codes, scales = checkpoint.read_quantized(name)
    if heads is not None:
        codes, scales = permute_rotary(codes, heads), permute_rotary(scales, heads)
    type_id, _ = packed_export_type(name, spec.quant_type, codes.shape[1], spec.group_size, config)
    if hybrid and type_id != T.F16:  # rows (and out_proj's whole scale groups) moved as they are
        codes, scales = gguf_qwen35.codes_to_stored(canon, codes, scales, config)
    if type_id == T.F16:
        w = dequantize(codes, scales, spec.group_size)  # [N, K]
        if hybrid:
            w = gguf_qwen35.to_stored(canon, w, config)
        err, ref = rounding_error(w, torch.float16)
        return w.to(torch.float16).numpy(), GGUFTensorExport(name, spec.quant_type, "F16", err, ref)
    raw, err, ref = gguf_codec.encode(codes, scales, spec.group_size, type_id)
    return raw, GGUFTensorExport(name, spec.quant_type, gguf_types.type_name(type_id), err, ref)
