"""The float model `bonsai quantize` reads: one tensor at a time by canonical name, row ranges of the big ones.

Sources: a HF directory (safetensors, plain reads of one tensor or of a range of its rows), a GGUF
(memory-mapped; only the rows asked for are decoded), a bonsai checkpoint (dequantized). Every tensor
comes out as float32 with the LoRA update merged and the rotation (engine.quantization.rotation) applied, so the
quantizer sees the model it quantizes and never holds more of it than one tensor, or a slice of rows
of the embedding / output layer. Names are those of the model written (`out_config`): a rotated tied
model's `lm_head.weight` is derived from the source's embedding.
"""
from __future__ import annotations

import torch

from engine.sources.checkpoint_file import BonsaiCheckpoint, canonical_name, hf_name
from engine.errors import ModelFileError
from engine.sources.gguf_file import GGUFFile
from engine.sources.hf_files import HFModelDir
from engine.quantization.lora import LoraAdapter
from engine.sources.model_config import ModelConfig
from engine.quantization.rotation import Rotation, norm_names, rotate_tensor
from quant.checkpoint import CheckpointError, SafetensorsFile
from quant.grids import dequantize

EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"


class FloatSource:
    """Float32 tensors of the model to quantize (source → LoRA merged → rotated), by canonical name."""

    def __init__(self, source: GGUFFile | HFModelDir | BonsaiCheckpoint, config: ModelConfig,
                 adapter: LoraAdapter | None = None, rotation: Rotation | None = None):
        self.source, self.config, self.adapter, self.rotation = source, config, adapter, rotation
        self._files: dict[str, tuple[SafetensorsFile, str]] = {}
        self._stored: tuple[str, tuple] | None = None  # a checkpoint source's last big tensor, as stored
        self.shapes: dict[str, tuple[int, ...]] = {}  # canonical name → shape, of the model written
        if isinstance(source, HFModelDir):
            for file in source.weight_files:
                try:
                    st = SafetensorsFile(file)
                except (CheckpointError, OSError) as e:
                    raise ModelFileError(f"{file} is not a valid safetensors file ({e})") from None
                for name, (_, shape, _, _) in st.entries.items():
                    if (canon := canonical_name(name)) is not None:
                        self._files[canon] = (st, name)
                        self.shapes[canon] = shape
        else:
            for name, _, shape, _ in source.tensor_info():
                canon = source.canonical(name) if isinstance(source, GGUFFile) else canonical_name(name)
                if canon is not None:
                    self.shapes[canon] = source.canonical_shape(canon, shape) if isinstance(source, GGUFFile) \
                        else tuple(shape)
        if config.tie_word_embeddings:
            self.shapes.pop(HEAD, None)  # a copy some tied checkpoints ship
            if rotation is not None:
                self.shapes[HEAD] = self.shapes[EMBED]
        self.norms = None
        if rotation is not None:  # the norm weights (small) first: every linear that reads one folds it
            self.norms = {n: self._raw(n) for n in norm_names(config)}

    @property
    def tied(self) -> bool:
        """Whether the model written has one tensor for the embedding and the output layer."""
        return HEAD not in self.shapes

    def layer_names(self, layer: int) -> list[str]:
        prefix = f"layers.{layer}."
        return [n for n in self.shapes if n.startswith(prefix)]

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor of the model written, float32."""
        return self._finish(name, self._raw(self._source_name(name)))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of the embedding or the output layer, float32 [stop - start, hidden]."""
        assert name in (EMBED, HEAD), name
        raw_name = self._source_name(name)
        if self.adapter is not None and hf_name(raw_name) in self.adapter.pairs:
            return self.read(name)[start:stop]
        return self._finish(name, self._raw(raw_name, (start, stop)), merged=True)

    def _source_name(self, name: str) -> str:
        return EMBED if name == HEAD and self.config.tie_word_embeddings else name

    def _raw(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        src = self.source
        if isinstance(src, HFModelDir):
            st, stored = self._files[name]
            return st.read(stored, rows).float()
        if isinstance(src, GGUFFile):
            return src.read_tensor(name, self.config, rows)
        if rows is None:
            return src.checkpoint.read_dequantized(hf_name(name))
        if self._stored is None or self._stored[0] != name:  # the codes of one big tensor, decoded once
            entry = src.checkpoint.entries[hf_name(name)]
            stored = (src.checkpoint.read_float(hf_name(name)),) if entry.is_float else \
                src.checkpoint.read_quantized(hf_name(name))
            self._stored = (name, stored)
        stored = self._stored[1]
        if len(stored) == 1:
            return stored[0][rows[0]:rows[1]].float()
        spec, codes, scales = stored
        return dequantize(codes[rows[0]:rows[1]], scales[rows[0]:rows[1]], spec.group_size)

    def _finish(self, name: str, w: torch.Tensor, merged: bool = False) -> torch.Tensor:
        if self.adapter is not None and not merged:
            w = self.adapter.merge(hf_name(self._source_name(name)), w)
        if self.rotation is not None:
            return rotate_tensor(name, w, self.rotation, self.norms)
        return w.float()

