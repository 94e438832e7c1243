"""Reading GGUF files: metadata, architecture, and tensors under our canonical names.

Canonical names are HF-like and unfused: `embed_tokens.weight`, `norm.weight`, `lm_head.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm,q_proj,k_proj,v_proj,o_proj,q_norm,k_norm,
gate_proj,up_proj,down_proj}.{weight,bias}`, `rope_freqs`.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources import gguf_qwen35
from engine.sources.gguf_reader import (GGUFFormatError, TensorExtent, UnknownTypeError, read_gguf, release_pages,
                                       tensor_bytes)
from engine.sources.model_check import check_tensors, in_file
from engine.sources.model_config import ModelConfig
from engine.sources import prism_rotation
from engine.sources.prism_rotation import InputRotationSpec
from engine.sources.tokenizer import Tokenizer
from quant import gguf_codec, gguf_int4, gguf_types, kquant_pack
from quant.rotation import block_hadamard_factors, signed_block_hadamard

_GGUF_MAGIC = b"GGUF"
_TOP_LEVEL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
          "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def canonical_name(gguf_name: str) -> str | None:
    """Our name for a GGUF tensor name, or None for tensors we do not use."""
    if gguf_name == "rope_freqs.weight":
        return "rope_freqs"
    m = _BLOCK_RE.match(gguf_name)
    if m:
        part = _BLOCK.get(m.group(2))
        return f"layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    stem, _, kind = gguf_name.rpartition(".")
    part = _TOP_LEVEL.get(stem)
    return f"{part}.{kind}" if part else None


def gguf_name(canonical: str) -> str:
    """The GGUF name of a canonical tensor name (the inverse of canonical_name)."""
    if canonical == "rope_freqs":
        return "rope_freqs.weight"
    stem, _, kind = canonical.rpartition(".")
    top = {v: k for k, v in _TOP_LEVEL.items()}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, layer, part = stem.split(".")
    return f"blk.{layer}.{ {v: k for k, v in _BLOCK.items()}[part]}.{kind}"


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation for llama GGUFs (half-split → interleaved rotary)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for llama GGUFs (interleaved → half-split rotary)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile:
    """An opened GGUF: metadata as plain Python values and lazily decoded tensors."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"model file not found: {self.path}")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelFileError(f"cannot read {self.path}: {e.strerror or e}; check its permissions") from None
        if magic != _GGUF_MAGIC:
            raise ModelFileError(f"{self.path} is not a GGUF file (it does not start with 'GGUF'); "
                                 "give a .gguf file, a Hugging Face model directory or a bonsai checkpoint")
        try:
            self.metadata_types: dict[str, tuple[int, int | None]] = {}
            self.metadata, extents, self._data = read_gguf(self.path, self.metadata_types)
        except UnknownTypeError as e:
            raise UnsupportedModelError(f"{self.path}: {e}, which bonsai does not decode (it reads "
                                        f"{_known_types()}); use a GGUF of one of those types") from None
        except (GGUFFormatError, OSError, ValueError, struct.error) as e:
            raise ModelFileError(f"{self.path} is a corrupt or truncated GGUF file ({_first_line(e)}); "
                                 "download it again") from None
        self._tensors: dict[str, TensorExtent] = {t.name: t for t in extents}
        # a Prism file's folded Hadamard rotation (engine.sources.prism_rotation), placed by model_config:
        # {linear layer: its input's rotation} for the run time, and the embedding's, undone as it is read
        self.prism = prism_rotation.parse(self.metadata, str(self.path))
        self.input_rotations: dict[str, InputRotationSpec] = {}
        self.embedding_rotation: InputRotationSpec | None = None

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def canonical_names(self) -> set[str]:
        """Our names of its tensors (those we read)."""
        return {name for t in self._tensors.values() if (name := self.canonical(t.name)) is not None}

    @property
    def _qwen35(self) -> bool:
        return self.metadata.get("general.architecture") == "qwen35"

    def canonical(self, stored: str) -> str | None:
        """Our name for one of its tensor names (canonical_name, or engine.sources.gguf_qwen35's)."""
        if not self._qwen35:
            return canonical_name(stored)
        layers, mtp = self.metadata.get("qwen35.block_count"), self.metadata.get("qwen35.nextn_predict_layers", 0)
        return gguf_qwen35.canonical_name(stored, layers - mtp if isinstance(layers, int) and isinstance(mtp, int)
                                          else None)

    def stored_name(self, canonical: str) -> str:
        """Its name of a canonical tensor (the inverse of canonical)."""
        return gguf_qwen35.gguf_name(canonical) if self._qwen35 else gguf_name(canonical)

    def keeps_codes(self, canonical: str, group: int) -> bool:
        """Whether iter_quantized_tensors yields this matrix's stored codes (qwen35: gguf_qwen35.keeps_codes)."""
        return not self._qwen35 or gguf_qwen35.keeps_codes(canonical, group, self.metadata)

    def canonical_shape(self, canonical: str, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The shape read_tensor gives a tensor stored with torch-order shape `stored`."""
        return gguf_qwen35.canonical_shape(canonical, stored) if self._qwen35 else tuple(stored)

    def model_config(self) -> ModelConfig:
        """The architecture its metadata declares, checked against its tensors (engine.sources.model_check)."""
        config = in_file(self.path, lambda: ModelConfig.from_gguf_metadata(self.metadata, self.tensor_names))
        used = {name: t for t in self._tensors.values() if (name := self.canonical(t.name)) is not None}
        check_tensors(self.path, config, {name: (t.name, self.canonical_shape(name, t.shape))
                                          for name, t in used.items()}, self.stored_name,
                      f"{config.architecture}.block_count")
        for t in used.values():
            if t.type_id not in gguf_types.DECODABLE_TYPES | gguf_types.CODEC_TYPES:
                raise UnsupportedModelError(f"{self.path}: tensor {t.name} is {gguf_types.type_name(t.type_id)} "
                                            f"(type id {t.type_id}), which bonsai does not decode (it reads "
                                            f"{_known_types()}); use a GGUF of one of those types")
        if self.prism is not None:  # the weights hold a rotation the activations get at run time
            self.input_rotations, self.embedding_rotation = prism_rotation.place(
                self.prism, config, self.tensor_names, str(self.path))
        return config

    def tokenizer(self) -> Tokenizer:
        return in_file(self.path, lambda: Tokenizer.from_gguf_metadata(self.metadata))

    def tensor_info(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """(name, type name, torch-order shape, bytes) of every tensor, in file order."""
        return [(t.name, gguf_types.type_name(t.type_id), t.shape, t.nbytes) for t in self._tensors.values()]

    def iter_canonical_tensors(self, config: ModelConfig, skip: frozenset[str] = frozenset()
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (canonical name, float32 tensor), one tensor decoded at a time; `skip` names are not read."""
        for t in self._tensors.values():
            name = self.canonical(t.name)
            if name is None or name in skip:
                continue
            yield name, self.read_tensor(name, config)

    def read_tensor(self, name: str, config: ModelConfig, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor by canonical name as float32 (llama q/k rows un-permuted); `rows` (start, stop): only
        those rows of a 2-D tensor are decoded (not for llama q/k, whose rows are permuted)."""
        t = self._tensors[self.stored_name(name)]
        raw, shape = tensor_bytes(self._data, t), t.shape
        if rows is not None:
            assert len(shape) == 2 and not name.endswith(("q_proj.weight", "k_proj.weight"))
            assert not (config.architecture == "qwen35" and gguf_qwen35.transformed(name))
            raw, shape = raw[rows[0]:rows[1]], (rows[1] - rows[0], shape[1])
        try:
            tensor = gguf_types.dequantize(raw, t.type_id, shape)
        except gguf_types.UnsupportedTensorType as e:
            raise UnsupportedModelError(f"{self.path.name}: tensor {t.name}: {e}") from None
        release_pages(self._data, t)  # decoded: its bytes leave the resident set (a view would fault them back)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute_rotary(tensor, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute_rotary(tensor, config.num_kv_heads)
        elif config.architecture == "qwen35":  # (a rotated hybrid file is refused: engine.sources.prism_rotation)
            tensor = gguf_qwen35.from_stored(name, tensor, config)
        elif name == "embed_tokens.weight" and self.embedding_rotation is not None:
            tensor = _unrotate_rows(tensor, self.embedding_rotation)
        return tensor

    def read_stored(self, stored: str) -> torch.Tensor:
        """One tensor by its name in the file, decoded to float32 as stored (no transform of any kind)."""
        t = self._tensors[stored]
        try:
            tensor = gguf_types.dequantize(tensor_bytes(self._data, t), t.type_id, t.shape)
        except gguf_types.UnsupportedTensorType as e:
            raise UnsupportedModelError(f"{self.path.name}: tensor {t.name}: {e}") from None
        release_pages(self._data, t)
        return tensor

    def int4_tensors(self, config: ModelConfig) -> set[str]:
        """Canonical names of the 2-D tensors stored in a type `read_int4` decodes (Q4_0/1, Q4_K, Q5_0/1, Q8_0);
        none for a hybrid (qwen35) file or a rotated (Prism) one, whose tensors are transformed as read."""
        if self._qwen35 or self.prism is not None:
            return set()
        names = {self.canonical(t.name): t for t in self._tensors.values() if t.type_id in gguf_int4.BLOCKS
                 and len(t.shape) == 2 and t.shape[-1] % gguf_int4.GROUP == 0}
        return {name for name in names if name is not None}

    def read_int4(self, name: str, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One int4_tensors tensor as stored: (codes uint8 [N, K'] 0..15, s, z float32 [N, K'/32]), w = (q − 8)·s + z
        (quant.gguf_int4), llama q/k rows un-permuted as read_tensor does."""
        t = self._tensors[self.stored_name(name)]
        codes, s, z = gguf_int4.decode_int4(tensor_bytes(self._data, t), t.type_id, t.shape[-1])
        release_pages(self._data, t)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if config.architecture == "llama" and heads is not None:
            codes, s, z = (_unpermute_rotary(x, heads) for x in (codes, s, z))
        return codes, s, z

    def block_type(self, name: str) -> int | None:
        """The GGUF type id of a 2-D tensor `read_packed` can read, else None (a hybrid or rotated file: its
        tensors are transformed as read)."""
        t = self._tensors.get(self.stored_name(name))
        if t is None or self._qwen35 or self.prism is not None or len(t.shape) != 2:
            return None
        return t.type_id

    def read_packed(self, name: str, config: ModelConfig) -> kquant_pack.Packed | None:
        """One tensor's blocks repacked for the CPU kernels (quant.kquant_pack), llama q/k rows un-permuted as
        read_tensor does; None where its type or values do not fit them."""
        t = self._tensors[self.stored_name(name)]
        raw = tensor_bytes(self._data, t)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if config.architecture == "llama" and heads is not None:
            raw = _unpermute_rotary(torch.from_numpy(np.array(raw)), heads).numpy()  # a copy: the map is read-only
        packed = kquant_pack.pack(raw, t.type_id, t.shape[-1])
        release_pages(self._data, t)
        return packed

    def iter_quantized_tensors(self, config: ModelConfig
                               ) -> Iterator[tuple[str, str, int, torch.Tensor, torch.Tensor]]:
        """Trained-ternary and 1-bit tensors (TQ1_0, TQ2_0, Q1_0, Q2_0) as they are stored, without
        requantizing: (canonical name, quant type, group size, codes int8 [N, K], scales float32 [N, K/G]).
        Q2_0 codes are {-1, 0, 1, 2}: 'tri' if a tensor uses no 2, else 'int4'."""
        for t in self._tensors.values():
            name = self.canonical(t.name)
            if name is None or t.type_id not in gguf_codec.IMPORTABLE or len(t.shape) != 2:
                continue
            codes, scales = gguf_codec.decode(tensor_bytes(self._data, t), t.type_id, t.shape[-1])
            release_pages(self._data, t)
            quant_type = gguf_codec.IMPORTABLE[t.type_id]
            if quant_type == "q2_0":
                quant_type = "int4" if bool((codes == 2).any()) else "tri"
            heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
            if config.architecture == "llama" and heads is not None:
                codes, scales = _unpermute_rotary(codes, heads), _unpermute_rotary(scales, heads)
            if config.architecture == "qwen35":
                if (ordered := gguf_qwen35.codes_from_stored(name, codes, scales, config)) is None:
                    continue
                codes, scales = ordered
            yield name, quant_type, t.shape[-1] // scales.shape[-1], codes, scales


def _unrotate_rows(table: torch.Tensor, spec: InputRotationSpec) -> torch.Tensor:
    """Rows E'[t] of an inverse-folded embedding (float32 [V, H], its own memory: gguf_types.dequantize copies
    out of the read-only map) → the hidden rows WHT_b(E'[t]) ⊙ s they stand for, in place."""
    h1, h2 = block_hadamard_factors(spec.block)
    signs = None if spec.signs is None else torch.tensor(spec.signs, dtype=torch.float32)  # [H]
    for start in range(0, table.shape[0], 4096):  # a slice at a time: the temporaries stay small
        table[start:start + 4096] = signed_block_hadamard(table[start:start + 4096], signs, h1, h2, inverse=True)
    return table


def _known_types() -> str:
    return ", ".join(sorted(gguf_types.type_name(int(i)) for i in gguf_types.DECODABLE_TYPES | gguf_types.CODEC_TYPES))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
