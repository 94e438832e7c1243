"""On the native CPU kernels, a block's decode rows in one C call (quant/kernels/cpu_kquant_step.h, kq_block).

A one-token decode step spent ~9 ms of its ~51 (Qwen2.5-Coder-1.5B, 2 threads) in torch between the products: ~20
small ops a layer (norms, rotary, the K/V write, one-query attention, SwiGLU, residual adds) and the products'
Python glue, each a dispatch and an allocation. Here a block whose four products run on the native kernels does all
of it in C, one call a block. Rows: the few of a decode step, a batched step or a speculative verify pass
(at most cpu_attention.EXACT_ROWS); each row's values do not depend on the call (every row one fixed sequence of
operations), so a verify row equals the decode step's bit for bit, as on the torch path. Anything else (prompt chunks,
a quantized or offloaded KV cache, q/k norms, rotations, gated attention) stays on the torch path: `__call__`
returns None there.
"""
from __future__ import annotations

import torch

from engine.runtime.cpu_attention import EXACT_ROWS
from engine.runtime.cpu_kquant import KQuantCpuLinear
from quant.kernels import cpu_rt


class StepRows:
    """What every block of one model passes kq_block for the current pass's rows, made once a pass (by the first
    block to see the pass's cos tensor and batch; forward_hidden makes both anew a pass): one tuple read and written
    whole, holding the tensors its pointers point into."""

    def __init__(self, rot_half: int):
        self.rot_half = rot_half
        self.last: tuple = (None, None, None)  # (cos, the rows' arguments or None, the tensors they point into)

    def args(self, cos: torch.Tensor, sin: torch.Tensor, batch) -> tuple | None:
        last = self.last
        if last[0] is cos and last[2][1] is batch:
            return last[1]
        positions, slots = batch.positions, batch.slot_ids  # [B, T], [B]
        ok = (positions.numel() <= EXACT_ROWS and positions.dtype == torch.int64 and slots.dtype == torch.int64
              and cos.dtype == sin.dtype == torch.float32 and cos.shape[-1] == self.rot_half
              and all(t.is_contiguous() for t in (positions, slots, cos, sin)))
        args = cpu_rt.rows_args(positions, slots, cos, sin) if ok else None
        self.last = (cos, args, (sin, batch))
        return args


class NativeBlockStep:
    """The C path of one Block (engine.runtime.model), built on first use from the block's modules."""

    def __init__(self, block: torch.nn.Module, rows: StepRows):
        self.block, self.rows = block, rows
        self.step: cpu_rt.BlockStep | None = None
        self.qkv: torch.nn.Module | None = None  # the q/k/v module the step was built from (a swap rebuilds it)
        self.cache: object | None = None  # the last cache seen, and its layer's pointers (None: not usable)
        self.kv: tuple | None = None
        self.lib = cpu_rt.library()

    def _build(self) -> cpu_rt.BlockStep | None:
        block = self.block
        attn, ffn = block.attention, block.feed_forward
        linears = [getattr(attn, "wqkv", None), getattr(attn, "wo", None), ffn.w13, ffn.w2]
        plain = (type(attn).__name__ == "Attention" and not attn.gated and attn.q_norm is None
                 and attn.fused_prologue is None and attn.wqkv_rotation is None and attn.wo_rotation is None
                 and ffn.w13_rotation is None and ffn.w2_rotation is None)
        if not plain or not all(isinstance(m, KQuantCpuLinear) for m in linears) or \
                any(m.bias is not None for m in linears[1:]):
            return None
        norms = [block.attention_norm.weight, block.ffn_norm.weight]
        cfg = attn.cfg
        if any(w.dtype != torch.float32 for w in norms) or cfg.rotary_dim // 2 != self.rows.rot_half:
            return None
        shape = dict(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     rot_half=cfg.rotary_dim // 2, inter=ffn.intermediate)
        bias = linears[0].bias
        return cpu_rt.BlockStep(shape, block.attention_norm.eps, *[w.detach().contiguous() for w in norms],
                                None if bias is None else bias.detach().float().contiguous(),
                                [m._call() for m in linears])

    def _bind(self, cache) -> None:
        """A resident float32 KV cache (plain rows: no offset, no rotation): its layer's pointers, else None."""
        ok = (not cache.streamed and cache.dtype == torch.float32 and cache.parts == {"k": ("",), "v": ("",)}
              and all(e == "float" for e in cache.elements.values()) and cache.device.type == "cpu")
        kv = cache.layer(self.block.attention.layer) if ok else None  # {name: [slots, KV, S, D]}
        self.cache, self.kv = cache, cpu_rt.cache_args(kv["k"], kv["v"]) if ok else None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, batch) -> torch.Tensor | None:
        """The block's output for x [B, T, H] (float32), or None where the torch path must run."""
        rows = self.rows.args(cos, sin, batch)
        if rows is None or x.dtype != torch.float32 or not x.is_contiguous():
            return None
        if cache is not self.cache:
            self._bind(cache)
        qkv = self.block.attention.wqkv
        if qkv is not self.qkv:
            self.step, self.qkv = self._build(), qkv
        if self.step is None or self.kv is None:
            return None
        return self.step.run_on(x, self.kv, rows, self.lib)  # [B, T, H]


def attach_native_steps(model: torch.nn.Module) -> None:
    """Give every block of `model` its C path (each decides on first use whether it applies)."""
    rows = StepRows(model.config.rotary_dim // 2)
    for block in model.layers:
        if hasattr(block, "feed_forward") and hasattr(block.attention, "wqkv"):
            block.native = NativeBlockStep(block, rows)
