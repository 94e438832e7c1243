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


class NativeBlockStep:
    """The C path of one Block (engine.runtime.model), built on first use from the block's modules."""

    def __init__(self, block: torch.nn.Module):
        self.block = block
        self.step: cpu_rt.BlockStep | None = None
        self.qkv: torch.nn.Module | None = None  # the q/k/v module the step was built from (a swap rebuilds it)
        self.cache: object | None = None  # the last cache found usable

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
        if any(w.dtype != torch.float32 for w in norms):
            return None
        cfg = attn.cfg
        shape = dict(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     rot_half=cfg.rotary_dim // 2, inter=ffn.intermediate)
        bias = linears[0].bias
        return cpu_rt.BlockStep(shape, block.attention_norm.eps, *[w.detach().contiguous() for w in norms],
                                None if bias is None else bias.detach().float().contiguous(),
                                [m._call() for m in linears])

    def _usable(self, cache) -> bool:
        """A resident float32 KV cache (plain rows: no offset, no rotation), checked once per cache."""
        if cache is self.cache:
            return True
        ok = (not cache.streamed and cache.dtype == torch.float32 and cache.parts == {"k": ("",), "v": ("",)}
              and all(e == "float" for e in cache.elements.values()) and cache.device.type == "cpu")
        if ok:
            self.cache = cache
        return ok

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, batch) -> torch.Tensor | None:
        """The block's output for x [B, T, H] (float32), or None where the torch path must run."""
        b, t, _ = x.shape
        if b * t > EXACT_ROWS or x.dtype != torch.float32 or not self._usable(cache):
            return None
        qkv = self.block.attention.wqkv
        if qkv is not self.qkv:
            self.step, self.qkv = self._build(), qkv
        if self.step is None:
            return None
        positions, slots = batch.positions, batch.slot_ids  # [B, T], [B]
        if positions.dtype != torch.int64 or slots.dtype != torch.int64 or cos.shape[-1] != self.step.spec.rot_half:
            return None
        kv = cache.layer(self.block.attention.layer)  # {name: [slots, KV, S, D]}
        return self.step.run(x.contiguous(), kv["k"], kv["v"], positions.contiguous(), slots.contiguous(),
                             cos.contiguous(), sin.contiguous())  # [B, T, H]


def attach_native_steps(model: torch.nn.Module) -> None:
    """Give every block of `model` its C path (each decides on first use whether it applies)."""
    for block in model.layers:
        if hasattr(block, "feed_forward") and hasattr(block.attention, "wqkv"):
            block.native = NativeBlockStep(block)
