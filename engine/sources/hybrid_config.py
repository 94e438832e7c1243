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
