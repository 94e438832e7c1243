"""The CPU output layer in float16 (or int8) with its top logits exact.

A float32 output layer is the largest matrix a small model reads per token (Qwen2.5-Coder-1.5B: 151,936 x
1,536, 0.93 GB of its 1.4 GB). Here one float16 GEMM (oneDNN, float32 accumulation) gives every logit, and
then, per row, the logits within that GEMM's error bound of the row's largest are recomputed in float32 from
the same float16 weights. So the greedy choice is the float32 product's (the true maximum is always among
the recomputed ones), near-ties are never made ties by float16 rounding, and the others keep a relative
error below 2^-10 (a sampling probability changes by < 0.1%). The recomputed values depend only on their
row and token, so a speculative verify pass picks what the one-row decode step picks.

`Int8Head` reads half those bytes: the one GEMM is torch's int8-weight kernel (one bfloat16 scale a row,
bfloat16 activations and output), its error bound wider (the rows' rounding to int8, bfloat16's), so more
logits are recomputed from the same float16 weights (Qwen2.5-Coder-0.5B on real text: 10 a row at the
median, 89 at most); greedy choices and top logits as the float16 head's, the others within ~0.02 of them
(mean KL 1e-4 at temperature 1: docs/quality.md, session 22).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.runtime.linear import Linear

UNIT = 2.0 ** -11  # float16's unit roundoff
BF16_UNIT = 2.0 ** -8  # bfloat16's


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

    def approximate(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one fast GEMM's logits [M, V] and a bound on their error [M, V] (flat [M, H] float32)."""
        logits = F.linear(flat.half(), self.weight).float()  # [M, V]
        return logits, error_bound(logits, flat, self.row_norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vocab, hidden = self.weight.shape
        rows = x.numel() // hidden
        flat = x.reshape(rows, hidden).float()  # [M, H]
        logits, err = self.approximate(flat)  # [M, V] each
        if not bool(torch.isfinite(logits).all()):  # an activation beyond the fast type's range: exact, slowly
            logits = flat @ self.weight.float().t()  # [M, V]
        else:
            recompute_near_top(logits, err, flat, lambda idx: self.weight[idx].float())
        if self.bias is not None:
            logits = logits + self.bias
        return logits.view(*x.shape[:-1], vocab).to(x.dtype)


def recompute_near_top(logits: torch.Tensor, err: torch.Tensor, flat: torch.Tensor, rows) -> None:
    """In place: per row of logits [M, V] (error bound err [M, V]), the logits that may be the row's largest
    recomputed in float32 from the weight rows `rows(idx)` gives (float32 [C, H]) and flat [M, H]."""
    floor = (logits - err).amax(-1, keepdim=True)  # [M, 1]: the true maximum is at least this
    for i, near in enumerate(logits + err >= floor):  # [V] bool: the tokens that may be the maximum
        idx = torch.nonzero(near).squeeze(1)  # [C]
        logits[i, idx] = (rows(idx) * flat[i]).sum(-1)  # [C]


def int8_error_bound(logits: torch.Tensor, x: torch.Tensor, row_norms: torch.Tensor,
                     delta_norms: torch.Tensor) -> torch.Tensor:
    """A bound on |int8 GEMM − float32 product with the float16 weights| per logit: the rows' rounding to int8
    (|Σ Δw·x| ≤ ‖x‖·‖Δw_v‖), bfloat16 activations and dequantized weights (2u·‖x‖·‖ŵ_v‖), float32 sums over K
    terms, the bfloat16 output (u·|l|), with a margin of 4u on the whole. logits [M, V], x [M, K],
    row_norms ‖ŵ_v‖ and delta_norms ‖Δw_v‖ [V] → [M, V]."""
    u = BF16_UNIT
    xn = x.norm(dim=-1, keepdim=True)  # [M, 1]
    return (1 + 4 * u) * (xn * (delta_norms + (2 * u + x.shape[-1] * 2.0 ** -24) * row_norms)
                          + u * logits.abs()) + 1e-6  # [M, V]


class Int8Head(NarrowHead):
    """NarrowHead whose one GEMM reads int8 codes (a bfloat16 scale a row): half the float16 head's bytes."""

    CHUNK = 16384  # rows coded at a time (the float32 temporaries of a 151,936-row head stay small)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        codes, scales, coded_norms, delta_norms = int8_codes(self.weight, self.CHUNK)  # [V, H], [V] x 3
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("coded_norms", coded_norms, persistent=False)
        self.register_buffer("delta_norms", delta_norms, persistent=False)

    def approximate(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch._weight_int8pack_mm(flat.bfloat16(), self.codes, self.scales).float()  # [M, V]
        return logits, int8_error_bound(logits, flat, self.coded_norms, self.delta_norms)


def int8_codes(weight: torch.Tensor, chunk: int = 16384) -> tuple[torch.Tensor, ...]:
    """weight [V, H] → int8 codes [V, H], bfloat16 scales [V] (a row's absmax / 127), and per row the norms of
    the coded row ‖ŵ_v‖ and of its error ‖w_v − ŵ_v‖ (float32 [V] each), chunk rows at a time."""
    vocab = weight.shape[0]
    codes = torch.empty(weight.shape, dtype=torch.int8)  # [V, H]
    scales = torch.empty(vocab, dtype=torch.bfloat16)  # [V]
    coded_norms, delta_norms = torch.empty(vocab), torch.empty(vocab)  # [V] each
    for start in range(0, vocab, chunk):
        w = weight[start:start + chunk].float()  # [C, H]
        s = (w.abs().amax(1) / 127).clamp_min(1e-30).bfloat16()  # [C]
        q = torch.round(w / s.float()[:, None]).clamp(-127, 127)  # [C, H]
        coded = q * s.float()[:, None]  # [C, H]
        codes[start:start + chunk], scales[start:start + chunk] = q.to(torch.int8), s
        coded_norms[start:start + chunk], delta_norms[start:start + chunk] = coded.norm(dim=1), (w - coded).norm(dim=1)
    return codes, scales, coded_norms, delta_norms


class Int8Linear(Linear):
    """A draft model's output layer as int8 codes only (a bfloat16 scale a row; no exact recomputation: a
    drafter's logits need not be exact, verification keeps the output exact): a quarter of float32's bytes."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        codes, scales, _, _ = int8_codes(weight)
        self.weight = torch.nn.Parameter(codes, requires_grad=False)  # [V, H] int8 (what a step reads)
        self.register_buffer("scales", scales, persistent=False)  # [V]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vocab, hidden = self.weight.shape
        flat = x.reshape(-1, hidden).bfloat16()  # [M, H]
        y = torch._weight_int8pack_mm(flat, self.weight, self.scales)  # [M, V] bfloat16
        return y.view(*x.shape[:-1], vocab).to(x.dtype)


@functools.cache
def int8_head_usable() -> bool:
    """Whether the int8 head pays and keeps its bound here: torch's int8-weight kernel is fast with AVX512
    (elsewhere the float16 head stays), checked once on random data against a float32 product."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 1024, generator=gen) * torch.rand(4096, 1, generator=gen)).half().float()  # [V, H]
    x = torch.randn(3, 1024, generator=gen) * 4  # [M, H]
    head = Int8Head(w)
    fast, err = head.approximate(x)  # [M, V] each
    return bool(((fast - x @ w.t()).abs() <= err).all())


def narrow_output_layer(model, dtype: str = "float16") -> bool:
    """Give a CPU model's float32 output layer (untied, or the tied embedding) a NarrowHead (dtype "float16") or
    an Int8Head ("int8"; the float16 one where int8_head_usable says no); False where it cannot (already narrow
    or packed, or this CPU's float16 GEMM does not keep the bound)."""
    if model.lm_head is not None and not (isinstance(model.lm_head, Linear) and type(model.lm_head) is Linear):
        return False
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    if weight.is_meta or weight.device.type != "cpu" or weight.dtype != torch.float32 or not fp16_gemm_bound_holds():
        return False
    bias = None if model.lm_head is None else model.lm_head.bias
    kind = Int8Head if dtype == "int8" and int8_head_usable() else NarrowHead
    model.lm_head = kind(weight.data, None if bias is None else bias.data)
    return True
