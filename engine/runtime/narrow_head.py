"""The CPU output layer in float16 with its top logits exact.

A float32 output layer is the largest matrix a small model reads per token (Qwen2.5-Coder-1.5B: 151,936 x
1,536, 0.93 GB of its 1.4 GB). Here one float16 GEMM (oneDNN, float32 accumulation) gives every logit, and
then, per row, the logits within that GEMM's error bound of the row's largest are recomputed in float32 from
the same float16 weights. So the greedy choice is the float32 product's (the true maximum is always among
the recomputed ones), near-ties are never made ties by float16 rounding, and the others keep a relative
error below 2^-10 (a sampling probability changes by < 0.1%). The recomputed values depend only on their
row and token, so a speculative verify pass picks what the one-row decode step picks.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.runtime.linear import Linear

UNIT = 2.0 ** -11  # float16's unit roundoff


@functools.cache
def fp16_gemm_bound_holds() -> bool:
    """Whether this CPU's float16 GEMM keeps within `error_bound` (it accumulates in float32): checked once on
    random data against a float32 product; where it does not, the output layer stays float32."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 2048, generator=gen).half()  # [V, H]
    x = torch.randn(3, 2048, generator=gen) * 4  # [M, H]
    fast = F.linear(x.half(), w).float()  # [M, V]
    exact = x @ w.float().t()  # [M, V]
    bound = error_bound(fast, x, w.float().norm(dim=1))  # [M, V]
    return bool(((fast - exact).abs() <= bound).all())


def error_bound(logits: torch.Tensor, x: torch.Tensor, row_norms: torch.Tensor) -> torch.Tensor:
    """A bound on |float16 GEMM − float32 product| per logit: the output's rounding (u·|l|), the input's
    (u·Σ|x_i w_vi| ≤ u·‖x‖·‖w_v‖) and float32 accumulation over K terms. logits [M, V], x [M, K],
    row_norms [V] → [M, V]."""
    u = UNIT + x.shape[-1] * 2.0 ** -24
    return u * (logits.abs() + x.norm(dim=-1, keepdim=True) * row_norms) + 1e-6  # [M, V]


class NarrowHead(Linear):
    """An output layer (a Linear whose weight is float16) computed as the module doc says."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.weight = torch.nn.Parameter(weight.detach().half().contiguous(), requires_grad=False)  # [V, H]
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.register_buffer("row_norms", self.weight.float().norm(dim=1), persistent=False)  # [V]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vocab, hidden = self.weight.shape
        rows = x.numel() // hidden
        flat = x.reshape(rows, hidden).float()  # [M, H]
        logits = F.linear(flat.half(), self.weight).float()  # [M, V]
        if not bool(torch.isfinite(logits).all()):  # an activation beyond float16's range: exact, slowly
            logits = flat @ self.weight.float().t()  # [M, V]
        else:
            err = error_bound(logits, flat, self.row_norms)  # [M, V]
            floor = (logits - err).amax(-1, keepdim=True)  # [M, 1]: the true maximum is at least this
            for i, near in enumerate(logits + err >= floor):  # [V] bool: the tokens that may be the maximum
                idx = torch.nonzero(near).squeeze(1)  # [C]
                logits[i, idx] = (self.weight[idx].float() * flat[i]).sum(-1)  # [C]
        if self.bias is not None:
            logits = logits + self.bias
        return logits.view(*x.shape[:-1], vocab).to(x.dtype)


def narrow_output_layer(model) -> bool:
    """Give a CPU model's float32 output layer (untied, or the tied embedding) a NarrowHead; False where it
    cannot (already narrow or packed, or this CPU's float16 GEMM does not keep the bound)."""
    if model.lm_head is not None and not (isinstance(model.lm_head, Linear) and type(model.lm_head) is Linear):
        return False
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    if weight.is_meta or weight.device.type != "cpu" or weight.dtype != torch.float32 or not fp16_gemm_bound_holds():
        return False
    bias = None if model.lm_head is None else model.lm_head.bias
    model.lm_head = NarrowHead(weight.data, None if bias is None else bias.data)
    return True
