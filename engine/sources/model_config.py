"""The architecture of a decoder-only transformer, read from a HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources.hybrid_config import HybridConfig
from engine.sources.model_limits import Fields

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen35")
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                     "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                     "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                   "qwen3_5_text": "qwen35", "qwen3_5": "qwen35"}


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
    hybrid: HybridConfig | None = None  # qwen35: DeltaNet / gated attention layer mix (engine.sources.hybrid_config)
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
        if (self.architecture == "qwen35") != (self.hybrid is not None):
            raise UnsupportedModelError("a qwen35 model needs its hybrid layer mix (layer_types), and only it has one")
        if self.hybrid is not None and len(self.hybrid.layer_types) != self.num_layers:
            raise UnsupportedModelError(f"layer_types lists {len(self.hybrid.layer_types)} layers, the model has "
                                        f"{self.num_layers}")

    @property
    def q_rows(self) -> int:
        """Rows of the q projection: a hybrid's attention also yields an output gate per head."""
        return self.q_size * (2 if self.hybrid else 1)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.hybrid.partial_rotary_factor) if self.hybrid else self.head_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (a hybrid's full-attention layers; every layer of a dense model)."""
        return self.hybrid.counts()["full_attention"] if self.hybrid else self.num_layers

    def is_linear(self, layer: int) -> bool:
        return self.hybrid is not None and self.hybrid.is_linear(layer)

    def layer_linear_shapes(self, layer: int) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of every linear layer of block `layer` (a hybrid's differ by kind)."""
        if not self.is_linear(layer):
            shapes = self.linear_shapes()
            shapes["q_proj"] = (self.q_rows, self.hidden_size)
            return shapes
        hc, h, f = self.hybrid, self.hidden_size, self.intermediate_size
        return {"in_proj_qkv": (hc.conv_dim, h), "in_proj_z": (hc.value_dim, h),
                "in_proj_b": (hc.linear_num_value_heads, h), "in_proj_a": (hc.linear_num_value_heads, h),
                "out_proj": (h, hc.value_dim), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}

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
        total = 0
        for layer in range(self.num_layers):
            total += sum(o * i for o, i in self.layer_linear_shapes(layer).values()) + 2 * self.hidden_size
            if self.is_linear(layer):
                hc = self.hybrid
                total += hc.conv_dim * hc.conv_kernel + 2 * hc.linear_num_value_heads + hc.linear_value_head_dim
                continue
            if self.attention_bias:
                total += self.q_size + 2 * self.kv_size
            if self.qk_norm:
                total += 2 * self.head_dim
        embed = self.vocab_size * self.hidden_size
        return total + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelConfig":
        """The architecture of a config.json (every number typed and bounded: engine.sources.model_limits)."""
        if not isinstance(cfg, dict):
            raise ModelFileError(f"config.json holds a JSON {type(cfg).__name__}, not an object of architecture keys")
        archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
        arch = next((_HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in _HF_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type", "?")
            arch = _HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
            if arch is None:
                raise UnsupportedModelError(f"unsupported architecture {archs or model_type!r} in config.json: "
                                            "bonsai runs Llama, Qwen2, Qwen3 and Qwen3.5/3.6")
        if arch == "qwen35" and isinstance(cfg.get("text_config"), dict):  # the VLM wrapper: its text model
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                         cfg["text_config"].get("tie_word_embeddings"))}
        if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window: true) is not supported")
        f = Fields(cfg)
        heads = f.count("num_attention_heads", "num_heads")
        hidden = f.count("hidden_size", "hidden_size")
        rope = f.mapping("rope_parameters") or {}
        return ModelConfig(
            architecture=arch,
            vocab_size=f.count("vocab_size", "vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.count("intermediate_size", "intermediate_size"),
            num_layers=f.count("num_hidden_layers", "num_layers"),
            num_heads=heads,
            num_kv_heads=f.count("num_key_value_heads", "num_kv_heads", heads),
            head_dim=f.count("head_dim", "head_dim", hidden // heads),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, high=1.0),
            rope_theta=f.number("rope_theta", Fields(rope).number("rope_theta", 10000.0)),
            max_position_embeddings=f.count("max_position_embeddings", "max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen35"),
            rope_scaling=_hf_rope_scaling(f.mapping("rope_scaling") or f.mapping("rope_parameters")),
            hybrid=HybridConfig.from_hf(cfg, f.count("num_hidden_layers", "num_layers")) if arch == "qwen35" else None,
        )

    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture '{arch}': bonsai runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        f = Fields(meta, f"{arch}.")
        hidden = f.count("embedding_length", "hidden_size")
        heads = f.count("attention.head_count", "num_heads")
        if f.has("vocab_size"):
            vocab = f.count("vocab_size", "vocab_size")
        else:
            tokens = meta.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if isinstance(tokens, list) else 0
            if not vocab:
                raise ModelFileError(f"the GGUF has neither {arch}.vocab_size nor a tokenizer.ggml.tokens list")
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        scaling = None
        if scaling_type == "linear":
            scaling = RopeScaling("linear", factor=f.number("rope.scaling.factor"))
        elif scaling_type not in ("none", None):
            raise UnsupportedModelError(f"unsupported rope scaling '{scaling_type}' in the GGUF")
        layers = f.count("block_count", "num_layers")
        if arch == "qwen35":  # llama.cpp appends the MTP blocks to block_count
            mtp = meta.get("qwen35.nextn_predict_layers", 0)
            if not isinstance(mtp, int) or not 0 <= mtp < layers:
                raise ModelFileError(f"qwen35.nextn_predict_layers is {mtp!r:.40}; it must be in 0..block_count-1")
            layers -= mtp
        head_dim = f.count("attention.key_length", "head_dim", hidden // heads)
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.count("feed_forward_length", "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=f.count("attention.head_count_kv", "num_kv_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=f.number("attention.layer_norm_rms_epsilon", 1e-6, high=1.0),
            rope_theta=f.number("rope.freq_base", 10000.0),
            max_position_embeddings=f.count("context_length", "max_position_embeddings", 4096),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names or arch == "qwen35",
            rope_scaling=scaling,
            hybrid=HybridConfig.from_gguf(meta, layers, head_dim) if arch == "qwen35" else None,
        )


def _hf_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    f = Fields(rs, "rope_scaling.")
    if kind == "linear":
        return RopeScaling("linear", factor=f.number("factor"))
    if kind == "llama3":
        return RopeScaling("llama3", factor=f.number("factor"),
                           low_freq_factor=f.number("low_freq_factor", 1.0),
                           high_freq_factor=f.number("high_freq_factor", 4.0),
                           original_max_position_embeddings=f.count("original_max_position_embeddings",
                                                                    "max_position_embeddings", 8192))
    raise UnsupportedModelError(f"unsupported rope scaling '{kind}': bonsai supports linear and llama3")
