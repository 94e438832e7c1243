"""One decoder block's pass over whole calibration sequences, as calibration runs it (no KV cache), and the
float model's pass that asymmetric calibration keeps next to the quantized one (engine.quantization.calibration).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.runtime.deltanet import GatedDeltaNet
from engine.runtime.model import Block


# The dtype of asymmetric calibration's extra products (the cross terms, the float gate/up copy down_proj's float
# inputs are recomputed from). Float32: in bfloat16 (4-5x faster on AMX / AVX512-BF16 CPUs) the float model's down_proj
# inputs carry bfloat16's rounding, a sizeable part of their difference from the quantized model's, and the fit got
# worse: Qwen2.5-Coder-1.5B seed command at alpha 0.25, 2.14x the source perplexity (KL 0.723) against 1.98x (0.627)
# in float32 (docs/quality.md, sessions 27-28).
CROSS_DTYPE = torch.float32


@dataclass
class FloatStream:
    """The float model on one block's calibration sequences (asymmetric calibration), computed before any of
    the block's weights is quantized: its inputs, o_proj's inputs, the residual after attention, the float
    gate/up weight (down_proj's float inputs are recomputed from it) and the block's outputs. Each part is
    dropped (None) once its stage is done."""
    inputs: list[torch.Tensor] | None  # [B, T, H] each
    attention: list[torch.Tensor] | None  # [B, T, q_size] each
    hidden: list[torch.Tensor] | None  # [B, T, H] each
    w13: torch.Tensor | None  # [2F, H] in CROSS_DTYPE
    outputs: list[torch.Tensor]  # [B, T, H] each


def attention_input(block: Block, x: torch.Tensor, rope) -> torch.Tensor:
    """The input of the attention's output projection for the residual stream x [B, T, H]."""
    if isinstance(block.attention, GatedDeltaNet):  # the gated-normed rule output, from the zero state
        return block.attention.over_sequences(block.attention_norm(x), project=False)
    return attention_output(block, x, *rope(x.shape[1]))


def out_proj(block: Block):
    return block.attention.out_proj if isinstance(block.attention, GatedDeltaNet) else block.attention.wo


def float_stream(block: Block, inputs: list[torch.Tensor], model) -> FloatStream:
    """The block's float pass over `inputs` (chunks [B, T, H]) keeping what asymmetric calibration needs."""
    rope = lambda t: rotary_tables(model, t, inputs[0].device)  # noqa: E731
    attention = [attention_input(block, x, rope) for x in inputs]
    hidden = [x + out_proj(block)(a) for x, a in zip(inputs, attention)]  # [B, T, H] each
    outputs = [h + block.feed_forward.w2(swiglu(block, h)) for h in hidden]
    w13 = block.feed_forward.w13.weight.detach().to(CROSS_DTYPE, copy=True)  # [2F, H]
    return FloatStream(list(inputs), attention, hidden, w13, outputs)


def attention_output(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The input of o_proj: causal self-attention of the whole sequences x [B, T, H], no KV cache
    (engine.model.Attention's own projection). Returns [B, T, q_size]."""
    attn = block.attention
    cfg = attn.cfg
    b, t, _ = x.shape
    q, k, v, gate = attn.project(block.attention_norm(x), cos, sin, with_gate=True)  # [B, H, T, D], [B, KV, T, D] x2
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=cfg.num_heads != cfg.num_kv_heads)  # [B, H, T, D]
    out = out.transpose(1, 2).reshape(b, t, cfg.q_size)
    return out if gate is None else out * torch.sigmoid(gate.float()).to(out.dtype)  # a hybrid's output gate


def swiglu(block: Block, h: torch.Tensor, w13: torch.Tensor | None = None) -> torch.Tensor:
    """The input of down_proj for the residual stream h [B, T, H] (after the online Hadamard of a
    rotated model), with the block's gate/up weight, or `w13` [2F, H] in its dtype: [B, T, F]."""
    x = block.ffn_norm(h)  # [B, T, H]
    return block.feed_forward.down_input(x if w13 is None else x.to(w13.dtype), w13)


def rotary_tables(model, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(seq_len, device=device)[None, :, None].float() * model.inv_freq.to(device)  # [1, T, D/2]
    return angles.cos()[:, :, None], angles.sin()[:, :, None]  # [1, T, 1, D/2]


def block_forward(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One block over whole sequences x [B, T, H] with the steps the calibration uses."""
    if isinstance(block.attention, GatedDeltaNet):  # a hybrid's DeltaNet layer, from the zero state
        h = x + block.attention.over_sequences(block.attention_norm(x))
        return h + block.feed_forward.w2(swiglu(block, h))
    h = x + block.attention.wo(attention_output(block, x, cos, sin))
    return h + block.feed_forward.w2(swiglu(block, h))
