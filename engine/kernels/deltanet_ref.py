"""What a hybrid's Gated DeltaNet layer computes in plain torch where no kernel runs (the references of
engine.kernels.deltanet_layer, the CPU path of engine.runtime.deltanet), and what the Triton chunked rule
(engine.kernels.deltanet_prefill) allocates; no triton import: the memory plan counts it on machines without one."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # positions per chunk of the chunked prefill


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_scratch_bytes(batch: int, rows: int, value_heads: int, key_dim: int, value_dim: int) -> int:
    """Bytes `chunk_gated_delta_rule_triton` allocates for `rows` positions of `batch` sequences: w, kd, u, v'
    [NT, ·] and cum per value head, the state before each chunk, and the float32 output."""
    nt = -(-rows // CHUNK) * CHUNK
    bk, bvs = max(16, _pow2(key_dim)), max(16, _pow2(value_dim))
    return 4 * batch * value_heads * (nt * (2 * bk + 2 * bvs + 1) + nt // CHUNK * bk * bvs + rows * value_dim)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU: x [B, C, T] after window [B, C, K-1] (the previous inputs), weight [C, K]
    → out [B, C, T] and every input seen [B, C, K-1+T] (its last K-1 columns are the next window)."""
    seen = torch.cat([window.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(seen.to(weight.dtype), weight[:, None, :], groups=weight.shape[0])  # [B, C, T]
    return F.silu(out).to(x.dtype), seen


def _gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the head dim, times SiLU(gate) (float32 maths): x, gate [.., D] → x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight.float() * h) * F.silu(gate.float())).to(gate.dtype)
