"""Pieces shared by the trained drafters (MTP, DFlash): their config and a transformer block whose
attention takes explicit keys/values, so one code path serves training (whole sequences under a
mask) and drafting (a small cache of its own).

The block reuses engine.runtime.model's Attention / FeedForward / RMSNorm, so a drafter block is the
target's block type with its own (smaller) sizes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from engine.errors import BonsaiError
from engine.runtime.input_rotation import rotated
from engine.runtime.model import (Attention, FeedForward, RMSNorm, Transformer, attention, linear,
                                  rotary_inverse_frequencies)
from engine.sources.model_config import ModelConfig

KINDS = ("mtp", "dflash")


@dataclass(frozen=True)
class DrafterConfig:
    """The shape of a drafter. hidden_size is the target's (embedding and LM head are shared).
    target_layers: target layers whose hidden states it reads (-1: the last block). block_size:
    the most tokens one proposal may hold (MTP: chained depth; DFlash: the trained block)."""
    kind: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layers: tuple[int, ...] = (-1,)
    block_size: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if self.kind not in KINDS:
            raise BonsaiError(f"unknown drafter kind '{self.kind}': use one of {', '.join(KINDS)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise BonsaiError(f"drafter config has {name} = {getattr(self, name)}; it must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise BonsaiError(f"drafter num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                              f"({self.num_kv_heads})")
        if not self.target_layers:
            raise BonsaiError("a drafter needs at least one target layer to read hidden states from")
        if self.kind == "mtp" and self.target_layers != (-1,):
            raise BonsaiError("an MTP drafter reads the target's last layer only (target_layers = (-1,))")

    def block_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig of one drafter block (what engine.runtime.model's Attention/FeedForward take)."""
        return ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layers": list(self.target_layers)}

    @staticmethod
    def from_dict(data: dict) -> "DrafterConfig":
        names = {f.name for f in fields(DrafterConfig)}
        unknown = set(data) - names
        if unknown:
            raise BonsaiError(f"drafter config has unknown keys {sorted(unknown)}: the file was written by "
                              "another bonsai version")
        return DrafterConfig(**data)


def default_config(kind: str, target: ModelConfig, block_size: int = 4, num_layers: int | None = None,
                   intermediate_size: int | None = None, target_layers: tuple[int, ...] | None = None
                   ) -> DrafterConfig:
    """A drafter sized for `target`: its attention shape, half its FFN width; MTP one block, DFlash
    two blocks reading three target layers spread over the depth (early, middle, last)."""
    n = target.num_layers
    if target_layers is None:
        target_layers = (-1,) if kind == "mtp" else tuple(sorted({min(1, n - 1), n // 2, n - 1}))
    return DrafterConfig(kind=kind, hidden_size=target.hidden_size,
                         intermediate_size=intermediate_size or max(target.intermediate_size // 2, 1),
                         num_layers=num_layers or (1 if kind == "mtp" else 2), num_heads=target.num_heads,
                         num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                         target_layers=target_layers, block_size=block_size,
                         rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)


class DraftBlock(nn.Module):
    """Pre-norm transformer block; queries of x attend to [keys/values given ; x's own] under `mask`.
    With a hybrid target's config it is that target's gated full-attention block (partial rotary,
    q/k norms, the output gate): the layer of a Qwen3.5 checkpoint's own MTP head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, 0)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, KV, T, D] of inputs x [B, T, hidden] (no norm: context features)."""
        _, k, v = self.attention.project(x, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden]; past_k/v [B, KV, S, D] or None; mask [B or 1, 1, T, S + T] (True = may
        attend) or None (attend to everything). Returns (out [B, T, hidden], k, v [B, KV, T, D])."""
        q, k, v, gate = self.attention.project(self.attention_norm(x), cos, sin, with_gate=True)  # [B, H, T, D], [B, KV, T, D]
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # [B, KV, S + T, D]
        values = v if past_v is None else torch.cat([past_v, v], dim=2)  # [B, KV, S + T, D]
        return self._after_attention(x, q, keys, values, gate, mask), k, v

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor,
                       cache_v: torch.Tensor, write: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`forward` over a static cache (capturable: no host values): x [1, T, hidden]; its keys/values written
        into cache_k/v [1, KV, S, D] at positions `write` [T] (a device tensor); the queries attend to the whole
        cache under mask [1, 1, T, S]. Returns out [1, T, hidden]."""
        q, k, v, gate = self.attention.project(self.attention_norm(x), cos, sin, with_gate=True)  # [1, H, T, D], [1, KV, T, D]
        cache_k.index_copy_(2, write, k)
        cache_v.index_copy_(2, write, v)
        return self._after_attention(x, q, cache_k, cache_v, gate, mask)

    def _after_attention(self, x, q, keys, values, gate, mask) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        # the engine's attention: on a GPU not cuDNN's, which plans each new length (~1 s: seen as 75 ms a call)
        out = attention(q, keys, values, mask, False, cfg.num_heads != cfg.num_kv_heads)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(b, t, cfg.q_size)  # [B, T, H*D]
        if gate is not None:  # a gated attention (Qwen3.5's, in its native MTP layer): sigmoid of the gate
            out = out * torch.sigmoid(gate.float()).to(out.dtype)
        x = x + self.attention.wo(out)
        return x + self.feed_forward(self.ffn_norm(x))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, 1, D/2] of positions [B, T] (the layout engine.runtime.model.apply_rotary takes)."""
    angles = positions[..., None].float() * inv_freq  # [B, T, D/2]
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def drafter_inverse_frequencies(cfg: DrafterConfig, vocab_size: int) -> torch.Tensor:
    return rotary_inverse_frequencies(cfg.block_config(vocab_size))


def init_drafter_weights(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Small normal weights, norms at one, the residual outputs (wo, w2) at zero: a fresh block is
    the identity on its input, so training starts from a stable point."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("wo.weight") or name.endswith("w2.weight"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def shared_logits(target: Transformer, hidden: torch.Tensor, vocab_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's final norm + LM head on drafter outputs [.., hidden] → logits [.., V] in float32;
    vocab_rows: only these output rows (training on a sub-vocabulary)."""
    x = target.norm(hidden.to(target.norm.weight.dtype))
    if vocab_rows is None:
        return target.output(x).float()
    weight = target.embed.weight if target.lm_head is None else getattr(target.lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise BonsaiError("training on a sub-vocabulary needs a float LM head; use --train-vocab full")
    return linear(rotated(target.lm_head_rotation, x).float(), weight[vocab_rows].float())  # [.., S]


def to_target(module: nn.Module, target_loaded) -> nn.Module:
    """The module on the target's device and dtype, for drafting (rotary frequencies kept float32)."""
    inv_freq = module.inv_freq
    module = module.to(device=target_loaded.device, dtype=target_loaded.dtype).eval()
    module.inv_freq = inv_freq.to(target_loaded.device)
    return module
