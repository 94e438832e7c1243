"""The architecture of a decoder-only transformer, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                     "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class RopeScaling:
    """Supported rope scalings: 'linear' (positions / factor) and 'llama3' (per-frequency factors)."""
    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: biases on q/k/v
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    rope_scaling: RopeScaling | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture '{self.architecture}': bonsai runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"model config has {name} = {getattr(self, name)}; it must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of every linear layer of one block."""
        h, f = self.hidden_size, self.intermediate_size
        return {"q_proj": (self.q_size, h), "k_proj": (self.kv_size, h), "v_proj": (self.kv_size, h),
                "o_proj": (h, self.q_size), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}

    def num_parameters(self) -> int:
        per_layer = sum(o * i for o, i in self.linear_shapes().values()) + 2 * self.hidden_size
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type", "?")
            arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
            if arch is None:
                raise UnsupportedModelError(
                    f"unsupported architecture {archs or model_type!r} in config.json: bonsai runs Llama, Qwen2 and Qwen3")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window: true) is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=_hf_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        )

    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture '{arch}': bonsai runs {', '.join(SUPPORTED_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"the GGUF lacks the metadata key '{arch}.{name}'")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        scaling = None
        if scaling_type == "linear":
            scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor")))
        elif scaling_type not in ("none", None):
            raise UnsupportedModelError(f"unsupported rope scaling '{scaling_type}' in the GGUF")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=scaling,
        )


def _hf_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(rs["factor"]),
                           low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
    raise UnsupportedModelError(f"unsupported rope scaling '{kind}': bonsai supports linear and llama3")
