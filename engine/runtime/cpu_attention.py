"""On the CPU, the few masked rows of a speculative verify pass (or a batched decode step) attend one query at a
time over the keys each one sees, exactly as the one-row decode step calls attention.

PyTorch's CPU flash kernel blocks its online softmax by the rows and keys it is given, so a row's output depends on
the call's shape: a 4-row verify pass over start + 4 keys with a causal mask gave logits up to 0.06-0.2 away from the
decode step's over start + 1 keys (Qwen2.5-Coder-1.5B, session 23: the first layer's attention output differed, every
matrix product was row-independent), and greedy speculation then diverged from plain decoding at near-ties (2 of 30
coder-suite runs), depending on which draft lengths the planner's timings chose. One single-query call per row over
its visible prefix, with no mask, is the decode step's call: the same values bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_ROWS = 16  # at most this many query rows (batch x tokens) run one by one; more are a prefill chunk


def rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      gqa: bool) -> torch.Tensor | None:
    """q [B, H, T, D], k/v [B, KV, S, D], mask [B, 1, T, S] bool → [B, H, T, D]; None where a row's mask is not a
    prefix of the keys (not a causal pass: the caller's masked call stands)."""
    b, _, t, _ = q.shape
    seen = mask[:, 0].sum(-1)  # [B, T]: keys each row sees
    prefix = torch.arange(mask.shape[-1], device=mask.device) < seen[..., None]  # [B, T, S]
    if not torch.equal(prefix, mask[:, 0]):
        return None
    out = torch.empty_like(q)  # [B, H, T, D]
    for i in range(b):
        for j in range(t):
            n = int(seen[i, j])
            out[i:i + 1, :, j:j + 1] = F.scaled_dot_product_attention(
                q[i:i + 1, :, j:j + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], enable_gqa=gqa)  # [1, H, 1, D]
    return out
