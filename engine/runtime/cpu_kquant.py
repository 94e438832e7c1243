"""A GGUF block matrix run on the CPU as stored by bonsai's own kernels (quant/kernels/cpu_kquant.c): every
block type a llama.cpp Q4_K_M / Q5_0 / Q8_0 file uses (Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) read at its
stored size (Q6_K 6.56 bits a weight where torch's kernels need bfloat16's 16; Q4_K 4.6 where torch's int4
layout takes 5), the activations rounded twice to int8 per 32 values (x ≈ u·(254·q1 + q2): ~16 bits, outputs equal
the float32 model's; one int8 pass as llama.cpp's flipped near-ties: docs/quality.md session 31), integer dot
products (AVX512-VNNI, or AVX2's byte products), and one pass over the weight bytes for all of a call's rows.

A fused layer (q/k/v, gate/up) keeps one packed matrix per stored part (each of its own type) and writes each
part's columns of one output. A row's result does not depend on how many rows share the call or on the thread
count (fixed operations per output), so a speculative verify pass gives the decode step's values bit for bit.
Prompt chunks of PREFILL_ROWS rows or more (where the CPU multiplies bfloat16 natively) decode the matrix to
bfloat16 a chunk of rows at a time and run GEMMs, as engine.runtime.cpu_int4_prefill does for torch's layout.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.linear import cpu_bf16_gemm
from engine.runtime.narrow_head import recompute_near_top
from quant import kquant_pack
from quant.kernels import cpu_rt

# From this many rows on (prompt chunks), decode + bfloat16 GEMMs: below it the kernel is faster (measured on an
# AVX512-BF16 CPU without AMX, the 1.5B's matrices: break-even 64-128 rows; docs/perf.md session 31)
PREFILL_ROWS = 96
CHUNK = 1 << 21  # weights decoded to bfloat16 at a time for a prompt chunk's GEMMs


@functools.cache
def _positions(fmt: str, kp: int) -> torch.Tensor:
    """[kp]: the input column each kernel position of a Q4_K / Q6_K matrix multiplies."""
    natural = torch.from_numpy(kquant_pack.NATURAL[fmt].astype(np.int64))  # [256]
    return (torch.arange(0, kp, 256)[:, None] + natural).reshape(-1)  # [kp]


class KQuantCpuLinear(nn.Module):
    """y = x Wᵀ (+ b), W the row-wise stack of packed parts (kquant_pack.Packed), each its own GGUF type."""

    def __init__(self, parts: list[kquant_pack.Packed], bias: torch.Tensor | None = None):
        super().__init__()
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"parts of different widths: {[p.k for p in parts]}")
        self.in_features, self.out_features = parts[0].k, sum(p.n for p in parts)
        self.parts = [(p.fmt, p.n, p.kp) for p in parts]
        for i, p in enumerate(parts):
            for name in ("qs", "qh", "meta"):
                self.register_buffer(f"{name}{i}", torch.from_numpy(np.ascontiguousarray(getattr(p, name))))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kinds = sorted({fmt for fmt, _, _ in self.parts})
        self._layer: cpu_rt.Layer | None = None  # the C call's arguments, built on first use from the buffers

    def _planes(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"qs{i}"), getattr(self, f"qh{i}"), getattr(self, f"meta{i}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for i in range(len(self.parts)) for t in self._planes(i))

    def dequantized(self) -> torch.Tensor:
        """The float32 [N, K] matrix this layer multiplies by, for references."""
        rows = []
        for i, (fmt, n, kp) in enumerate(self.parts):
            qs, qh, meta = (t.numpy() for t in self._planes(i))
            rows.append(kquant_pack.dequantize(kquant_pack.Packed(fmt, n, self.in_features, kp, qs, qh, meta)))
        return torch.from_numpy(np.concatenate(rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features).float()  # [M, K]
        if rows >= PREFILL_ROWS and cpu_bf16_gemm():
            y = self._prefill(flat.to(torch.bfloat16)).float()  # [M, N]
        else:
            y = self._call().run(flat.contiguous())  # [M, N]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _call(self) -> cpu_rt.Layer:
        """The C call's arguments for the current buffers (rebuilt if they were replaced, e.g. by a load)."""
        if self._layer is None or self._layer.keep[0].data_ptr() != self.qs0.data_ptr():
            self._layer = cpu_rt.Layer([(fmt, *self._planes(i), n, kp) for i, (fmt, n, kp) in enumerate(self.parts)],
                                       self.in_features)
        return self._layer

    def _prefill(self, xb: torch.Tensor) -> torch.Tensor:
        """bfloat16 x [M, K] → bfloat16 [M, N]: each part decoded CHUNK weights at a time, one GEMM a chunk (Q4_K /
        Q6_K columns come in the kernel's positions within each 256-block: the input is permuted to match)."""
        outs, inputs = [], {}
        for i, (fmt, n, kp) in enumerate(self.parts):
            if fmt not in inputs:
                inputs[fmt] = xb[:, _positions(fmt, kp)] if fmt in kquant_pack.NATURAL else xb  # [M, K]
            step = max(1, CHUNK // kp)
            for r in range(0, n, step):
                w = cpu_rt.dequant_bf16(fmt, *self._planes(i), r, min(n, r + step), kp)[:, :self.in_features]
                outs.append(F.linear(inputs[fmt], w))  # [M, rows of this chunk]
        return torch.cat(outs, dim=-1)


def layer_types(source, parts: list[str]) -> list[int] | None:
    """The GGUF types of a layer's stored parts if the kernels take every one, else None."""
    types = [source.block_type(name) for name in parts] if hasattr(source, "block_type") else [None]
    return types if all(t in kquant_pack.PACKABLE for t in types) else None


class KQuantHead(KQuantCpuLinear):
    """An output layer stored in a block type, run by the native kernels with its top logits exact: one kernel
    pass gives every logit (two-pass int8 activations), then per row the logits within a bound of that pass's error
    of the row's largest are recomputed in float32 from the stored values (kq_dequant_rows), as
    engine.runtime.narrow_head does for float weights. The bound: |Σ w·(x̂ − x)| ≤ ‖w_v‖·‖x̂ − x‖, each
    activation within half its 32-block's unit u of x, plus float32 rounding; so the greedy choice and the top logits are the
    float32 product's with the file's weights, and a row's values do not depend on the call (verify = decode)."""

    def __init__(self, part: kquant_pack.Packed, bias: torch.Tensor | None = None):
        super().__init__([part], bias)
        norms = torch.empty(part.n)  # [V]: ‖w_v‖ of the stored rows
        for start in range(0, part.n, 8192):
            rows = torch.arange(start, min(part.n, start + 8192))
            norms[start:start + len(rows)] = cpu_rt.dequant_rows(part.fmt, *self._planes(0), rows, part.kp).norm(dim=1)
        self.register_buffer("row_norms", norms, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, hidden = x.numel() // self.in_features, self.in_features
        flat = x.reshape(rows, hidden).float()  # [M, H]
        logits = self._call().run(flat.contiguous())  # [M, V]
        step = flat.view(rows, -1, 32).abs().amax(-1) / (127 * 254)  # [M, H/32]: each block's unit (cpu_kquant.c)
        x_err = (step.square().sum(-1, keepdim=True) * 8).sqrt()  # [M, 1]: ‖x̂ − x‖ ≤ 1.02·sqrt(Σ 32·(u/2)²)
        scale = x_err * 1.02 + flat.norm(dim=-1, keepdim=True) * hidden * 2.0 ** -22  # [M, 1]
        fmt, _, kp = self.parts[0]
        rows_of = lambda idx: cpu_rt.dequant_rows(fmt, *self._planes(0), idx, kp)[:, :hidden]  # noqa: E731 [C, H]
        near = cpu_rt.near_top(logits, self.row_norms, scale.reshape(-1).contiguous(), 1e-5)  # C: one pass over V
        if near is None:  # a row with many candidates (an outlier's coarse unit): torch's selection, the reference
            recompute_near_top(logits, self.row_norms * scale + 1e-5, flat, rows_of)  # err [M, V]
        for i, idx in enumerate(near or ()):  # recompute_near_top's recomputation of the C pass's candidates
            logits[i, idx] = (rows_of(idx) * flat[i]).sum(-1)  # [C]
        if self.bias is not None:
            logits = logits + self.bias
        return logits.view(*x.shape[:-1], self.out_features).to(x.dtype)
