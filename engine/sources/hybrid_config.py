"""The hybrid layer mix of Qwen3.5 / Qwen3.6 (Gated DeltaNet linear attention + gated full attention)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError
from engine.sources.model_limits import Fields

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_KINDS = (LINEAR, FULL)


@dataclass(frozen=True)
class HybridConfig:
    """layer_types: one kind per layer (LAYER_KINDS); the DeltaNet layers' heads; partial rotary of the
    attention layers (their q projection also yields an output gate per head)."""
    layer_types: tuple[str, ...]
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel: int = 4
    partial_rotary_factor: float = 0.25

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_KINDS:
                raise UnsupportedModelError(f"layer_types[{i}] is '{kind}': bonsai runs {' and '.join(LAYER_KINDS)} layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple "
                                        f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0 < self.partial_rotary_factor <= 1:
            raise UnsupportedModelError(f"partial_rotary_factor is {self.partial_rotary_factor}; it must be in (0, 1]")

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (q, k and v of the DeltaNet layer)."""
        return 2 * self.key_dim + self.value_dim

    def state_index(self, layer: int) -> int:
        """The index among the layers of its own kind (DeltaNet state, or KV cache layer)."""
        kind = self.layer_types[layer]
        return sum(k == kind for k in self.layer_types[:layer])

    def counts(self) -> dict[str, int]:
        return {kind: sum(k == kind for k in self.layer_types) for kind in LAYER_KINDS}

    def state_bytes_per_slot(self, conv_bytes: int = 4) -> int:
        """A sequence's DeltaNet state: fp32 [value heads, key dim, value dim] + the conv window, per linear layer."""
        rec = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_bytes
        return self.counts()[LINEAR] * (rec + conv)

    @staticmethod
    def from_hf(cfg: dict[str, Any], num_layers: int) -> "HybridConfig":
        f = Fields(cfg)
        types = cfg.get("layer_types")
        if types is None:
            interval = f.count("full_attention_interval", "num_layers", 4)
            types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers:
            raise UnsupportedModelError(f"layer_types must list one kind per layer ({num_layers}), got {types!r:.80}")
        rope = f.mapping("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        return HybridConfig(tuple(str(t) for t in types),
                            f.count("linear_num_key_heads", "num_heads", 16),
                            f.count("linear_num_value_heads", "num_heads", 32),
                            f.count("linear_key_head_dim", "head_dim", 128),
                            f.count("linear_value_head_dim", "head_dim", 128),
                            f.count("linear_conv_kernel_dim", "num_layers", 4),
                            float(partial))

    @staticmethod
    def from_gguf(meta: dict[str, Any], num_layers: int, head_dim: int) -> "HybridConfig":
        """The layer mix of a llama.cpp `qwen35` GGUF (docs/qwen35_gguf.md): ssm.group_count key heads,
        ssm.time_step_rank value heads, ssm.state_size the key head dim, ssm.inner_size all value dims,
        DeltaNet layers where (i + 1) % full_attention_interval != 0 unless attention.recurrent_layers
        lists them, rope.dimension_count / attention.key_length the rotary part."""
        f = Fields(meta, "qwen35.")
        key_heads = f.count("ssm.group_count", "num_heads")
        value_heads = f.count("ssm.time_step_rank", "num_heads")
        inner = f.count("ssm.inner_size", "intermediate_size")
        if inner % value_heads:
            raise UnsupportedModelError(f"qwen35.ssm.inner_size ({inner}) is not a multiple of "
                                        f"qwen35.ssm.time_step_rank ({value_heads}); the file's metadata is inconsistent")
        recurrent = meta.get("qwen35.attention.recurrent_layers")
        if recurrent is None:
            interval = f.count("full_attention_interval", "num_layers", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
        if not isinstance(recurrent, list) or len(recurrent) < num_layers:
            raise UnsupportedModelError(f"qwen35.attention.recurrent_layers must list one flag per layer "
                                        f"({num_layers}), got {recurrent!r:.80}")
        if f.count("attention.value_length", "head_dim", head_dim) != head_dim:
            raise UnsupportedModelError(f"qwen35.attention.value_length ({meta['qwen35.attention.value_length']}) "
                                        f"differs from attention.key_length ({head_dim}); bonsai runs equal ones")
        rotary = f.count("rope.dimension_count", "head_dim", head_dim)
        if rotary > head_dim or rotary % 2:
            raise UnsupportedModelError(f"qwen35.rope.dimension_count is {rotary}; it must be even and at most "
                                        f"attention.key_length ({head_dim})")
        return HybridConfig(tuple(LINEAR if r else FULL for r in recurrent[:num_layers]), key_heads, value_heads,
                            f.count("ssm.state_size", "head_dim"), inner // value_heads,
                            f.count("ssm.conv_kernel", "num_layers"), rotary / head_dim)
