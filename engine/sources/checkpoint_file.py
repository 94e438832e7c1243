"""Bonsai checkpoints as a model source, with the interface of GGUFFile and HFModelDir.

`iter_canonical_tensors` yields float weights (packed ones dequantized); `iter_quantized_tensors`
yields the codes and scales of packed ones, for runtimes that execute them directly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from engine.errors import ModelFileError
from engine.sources.hf_files import canonical_name as _hf_canonical
from engine.sources.hf_files import checked_config
from engine.sources.hf_files import hf_name  # noqa: F401 - the inverse of canonical_name, used with it
from engine.sources.model_config import ModelConfig
from engine.sources.tokenizer import Tokenizer
from quant.checkpoint import Checkpoint, CheckpointError

_HF_ARCHITECTURE = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                    "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text")}


def canonical_name(name: str) -> str | None:
    """Our canonical name of a checkpoint tensor (HF names, plus `rope_freqs` from GGUF sources)."""
    return "rope_freqs" if name == "rope_freqs" else _hf_canonical(name)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config.json describing `cfg` (for checkpoints made from a GGUF)."""
    arch_class, model_type = _HF_ARCHITECTURE[cfg.architecture]
    out: dict[str, Any] = {
        "architectures": [arch_class], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if cfg.architecture != "qwen2":
        out["attention_bias"] = cfg.attention_bias
    if cfg.hybrid is not None:  # Qwen3.5's layer mix, read back by HybridConfig.from_hf
        hc = cfg.hybrid
        out |= {"layer_types": list(hc.layer_types), "linear_num_key_heads": hc.linear_num_key_heads,
                "linear_num_value_heads": hc.linear_num_value_heads, "linear_key_head_dim": hc.linear_key_head_dim,
                "linear_value_head_dim": hc.linear_value_head_dim, "linear_conv_kernel_dim": hc.conv_kernel,
                "partial_rotary_factor": hc.partial_rotary_factor}
    rs = cfg.rope_scaling
    if rs is not None and rs.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
    elif rs is not None:
        out["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_position_embeddings}
    return out


class BonsaiCheckpoint:
    """An opened bonsai checkpoint directory."""
    format_name = "bonsai"

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.checkpoint = Checkpoint(self.path)
        except OSError as e:
            raise ModelFileError(f"cannot read {e.filename or self.path}: {e.strerror or e}; check its "
                                 "permissions") from None
        except CheckpointError as e:
            raise ModelFileError(f"{self.path} is a corrupt bonsai checkpoint ({e}); quantize it again") from None
        except ValueError as e:  # a tensor entry whose group does not fit its shape
            raise ModelFileError(f"{self.path} is a corrupt bonsai checkpoint ({e})") from None
        self.hf_config = self.checkpoint.config
        self.rotation = self.checkpoint.rotation  # {"down_proj_hadamard": b, ...} of a rotated model, or None
        self.metadata = {"format": "bonsai"}

    def model_config(self) -> ModelConfig:
        """The architecture config.json declares, checked against the tensors (engine.sources.model_check)."""
        return checked_config(self.path, self.hf_config, self.tensor_info, canonical_name)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_dir(self.path)

    def tensor_info(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """(name, type (e.g. 'tri g64', 'bf16'), original shape, stored bytes) of every tensor."""
        out = []
        for name, entry in self.checkpoint.entries.items():
            label = entry.quant_type if entry.is_float else f"{entry.quant_type} g{entry.group_size}"
            out.append((name, label, entry.shape, self.checkpoint.stored_bytes(name)))
        return out

    def iter_canonical_tensors(self, config: ModelConfig, skip: frozenset[str] = frozenset()
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, float32 tensor), one at a time; names in `skip` are not read."""
        for name in self.checkpoint.entries:
            canon = canonical_name(name)
            if canon is not None and canon not in skip:
                yield canon, self._read(name, self.checkpoint.read_dequantized)

    def iter_quantized_tensors(self, config: ModelConfig
                               ) -> Iterator[tuple[str, str, int, torch.Tensor, torch.Tensor]]:
        """(canonical name, quant type, group size, codes int8 [N, K], scales float32 [N, K/G])."""
        for name, entry in self.checkpoint.entries.items():
            canon = canonical_name(name)
            if canon is None or entry.is_float:
                continue
            spec, codes, scales = self._read(name, self.checkpoint.read_quantized)
            yield canon, spec.quant_type, spec.group_size, codes, scales

    def _read(self, name: str, reader: Any) -> Any:
        try:
            return reader(name)
        except (CheckpointError, OSError, ValueError) as e:
            raise ModelFileError(f"{self.path}: cannot read tensor {name} ({e})") from None
