"""One decode step for M ≤ 16 rows with fused kernels — the body the CUDA graph captures.

Unlike `Transformer.forward` (used for prefill), the residual stream stays float32 and every
projection of a packed layer takes int8 activations made in one fused kernel (RMSNorm → int8, or
SwiGLU → int8, or plain → int8); the two projections that end a sub-block (o_proj, down_proj) add
themselves into the residual stream in place. Rows may belong to different slots and positions
(batched decode, or the rows of a speculative verify step: each row's seq_len is position + 1).
On the CPU (or without Triton) the same step runs through the kernels' plain-torch references.
A layer whose weight holds a folded rotation (engine.runtime.input_rotation: a rotated checkpoint's
down projection, a Prism GGUF's projections) gets its input made in plain torch (RMSNorm / SwiGLU /
attention output, then the rotation) before the activation quantization: the fused prologues would
quantize the unrotated input (no fused kernel for the rotation yet).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import kernels_usable
from engine.runtime.hybrid_step import deltanet_step, gated_attention_step
from engine.runtime.input_rotation import InputRotation
from engine.runtime.kv_cache import KVCache
from engine.runtime.model import Transformer
from engine.weights.packed_linear import PackedLinear

MAX_STEP_ROWS = 16  # rows one fused step takes: the packed GEMV's limit (quant/kernels/packed_gemv.py)


@dataclass
class StepInputs:
    """Device tensors describing the rows of one step (static buffers when graphed)."""
    tokens: torch.Tensor  # [M] int64
    positions: torch.Tensor  # [M] int32, absolute position of each row's token
    slot_ids: torch.Tensor  # [M] int32
    seq_lens: torch.Tensor  # [M] int32 = positions + 1 (keys each row attends to)
    embedded: torch.Tensor | None = None  # [M, H] the rows' embeddings, when the table is in host memory
    hidden: torch.Tensor | None = None  # [M, H] float32: a pipeline stage's input (model.takes_tokens false)
    # a hybrid's step of several rows: rows of one slot in runs (a verify; engine.kernels.deltanet_decode)
    run_len: torch.Tensor | None = None  # [M] int32: at a slot's first row its count of rows, 0 at the others
    snap_idx: torch.Tensor | None = None  # [M] int32: where the DeltaNet state after the row is kept (-1: not)


@dataclass
class Workspace:
    """Static float32 accumulation buffers of the split-K projections whose consumers read them
    whole (q/k/v → rope; gate/up → SwiGLU). They start at zero, the projection adds into them with
    atomics, and the consumer kernel zeroes them again as it reads: no memset between kernels."""
    qkv: torch.Tensor  # [M, Q + 2KV]
    gate_up: torch.Tensor  # [M, 2F]
    # the residual stream after the last block, before the final norm: what drafters that read the target's
    # hidden state take (engine.speculative.hidden_drafter); copied there by each step (valid until the next)
    hidden: torch.Tensor  # [M, H]
    ffn: object | None = None  # quant.kernels.persistent_ffn.FfnBuffers: the one-launch FFN's scratch (one row)
    # one row on the CUDA C++ products: down takes the [gate | up] rows itself (SwiGLU and int8 in its kernel), so
    # gate_up is not zeroed as it is read; each block's q/k/v product zeroes it instead (quant.kernels.cuda_gemv)
    swiglu_in_down: bool = False
    # one row: q/k norm, rotary, K/V write, attention and o_proj's int8 input in one CUDA C++ launch a layer
    # (engine.kernels.cuda_attention): its split partials and counters
    attention: object | None = None

    @staticmethod
    def make(model: Transformer, rows: int, device: torch.device, persistent_ffn: bool = False,
             cache: KVCache | None = None) -> "Workspace":
        cfg = model.config
        ws = Workspace(torch.zeros(rows, cfg.q_size + 2 * cfg.kv_size, device=device),
                       torch.zeros(rows, 2 * cfg.intermediate_size, device=device),
                       torch.zeros(rows, cfg.hidden_size, device=device))
        if persistent_ffn and rows == 1:
            group = next((b.feed_forward.w13.group_size for b in model.layers
                          if isinstance(b.feed_forward.w13, PackedLinear)), None)
            if group is not None:
                from quant.kernels.persistent_ffn import FfnBuffers
                ws.ffn = FfnBuffers.make(cfg.hidden_size, cfg.intermediate_size, group, device, gu=ws.gate_up[0])
        ws.swiglu_in_down = rows == 1 and ws.ffn is None and _swiglu_in_down(model, device)
        if rows == 1 and cache is not None and fused_attention_taken(model, cache):
            from engine.kernels.cuda_attention import AttentionBuffers
            ws.attention = AttentionBuffers.make(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cache.max_seq_len,
                                                 device, combine=not _splits_in_o_proj(model, device))
        return ws


def fused_attention_taken(model: Transformer, cache: KVCache) -> bool:
    """Whether a one-row step runs each block's attention in one CUDA C++ launch (engine.kernels.cuda_attention):
    on (BONSAI_CUDA_ATTN), not a hybrid, a float cache of 16-bit rows in the GPU's memory, every o_proj packed at
    group = head_dim without a rotation, q/k norms (if any) in the cache's dtype."""
    from engine.kernels import cuda_attention as ca
    cfg = model.config
    if not ca.enabled(cache.device) or cfg.hybrid is not None or not model.layers or cache.streamed:
        return False
    if not ca.shape_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) or cache.layer_scales(0) \
            or cache.key_offset is not None or model.inv_freq.dtype != torch.float32 \
            or model.inv_freq.numel() != cfg.head_dim // 2:
        return False
    kv = cache.layer(0)
    if not ca.cache_taken(kv["k"], kv["v"], cfg.head_dim):
        return False
    for block in model.layers:
        att = block.attention
        if not isinstance(att.wo, PackedLinear) or att.wo.group_size != cfg.head_dim or att.wo_rotation is not None:
            return False
        norms = [n.weight for n in (att.q_norm, att.k_norm) if n is not None]
        if len(norms) == 1 or any(w.dtype != cache.dtype or not w.is_contiguous() for w in norms):
            return False
    return True


def _splits_in_o_proj(model: Transformer, device: torch.device) -> bool:
    """Whether every block's o_proj can combine its attention's splits itself (cuda_gemv.cuda_splits_gemv, on
    where measured faster: engine.kernels.cuda_attention.combine_in_product): heads of 128, o_proj on the CUDA C++
    path, no bias."""
    from engine.kernels.cuda_attention import combine_in_product
    from quant.kernels.cuda_gemv import splits_input_taken
    if not combine_in_product(model.config.num_heads):
        return False
    return all(block.attention.wo.bias is None and splits_input_taken(device, block.attention.wo.packed,
                                                                         model.config.head_dim)
               for block in model.layers)


def _swiglu_in_down(model: Transformer, device: torch.device) -> bool:
    """Whether every block's down product can take its SwiGLU input itself (not a hybrid; packed gate/up and down
    without rotations, down on the CUDA C++ path)."""
    from quant.kernels.cuda_gemv import swiglu_input_taken
    if model.config.hybrid is not None or not model.layers:
        return False
    for block in model.layers:
        ffn = block.feed_forward
        if not (isinstance(ffn.w13, PackedLinear) and isinstance(ffn.w2, PackedLinear)):
            return False
        if ffn.w13_rotation is not None or ffn.w2_rotation is not None or not swiglu_input_taken(device, ffn.w2.packed):
            return False
    return True


class _Ops:
    """The kernels or their references, chosen once per device."""

    def __init__(self, device: torch.device, kernels: bool | None = None):
        fast = kernels_usable(device) if kernels is None else kernels
        if fast:
            from engine.kernels.attention_decode import decode_attention, decode_attention_int8
            from engine.kernels.rope_cache import qk_norm_rope_write
            from quant.kernels.act_quant import quantize_activations
            from quant.kernels.packed_gemv import packed_gemv
        else:
            from engine.kernels.attention_decode import decode_attention_reference as decode_attention
            from engine.kernels.attention_decode import decode_attention_int8_reference as decode_attention_int8
            from engine.kernels.rope_cache import qk_norm_rope_write_reference as qk_norm_rope_write
            from quant.kernels.act_quant import quantize_activations_reference as quantize_activations
            from quant.kernels.packed_gemv import packed_gemv_reference as packed_gemv
        self.fast = fast
        self.attention, self.rope_write = decode_attention, qk_norm_rope_write
        self.attention_int8 = decode_attention_int8  # attention → int8 per head, for a packed o_proj
        self.quantize, self.gemv = quantize_activations, packed_gemv
        from quant.kernels.cuda_gemv import cuda_norm_gemv, cuda_swiglu_gemv, norm_input_taken
        self.norm_gemv, self.swiglu_gemv = cuda_norm_gemv, cuda_swiglu_gemv  # one row, CUDA C++, where taken:
        self.norm_gemv_takes = norm_input_taken if fast else lambda x, w, pw: False
        if fast:  # one row's attention block in one launch, where the workspace has its buffers
            from engine.kernels.cuda_attention import rope_attention
        else:
            from engine.kernels.cuda_attention import rope_attention_reference as rope_attention
        self.rope_attention = rope_attention
        # ... or its splits' partials, which o_proj's CUDA C++ product combines (GPU only: no reference step)
        from engine.kernels.cuda_attention import rope_attention_partials
        from quant.kernels.cuda_gemv import cuda_splits_gemv
        self.rope_attention_partials, self.splits_gemv = rope_attention_partials, cuda_splits_gemv
        if fast:  # a hybrid's DeltaNet and gated attention layers (engine.runtime.hybrid_step)
            from engine.kernels.deltanet_decode import conv_update, recurrent_update
            from engine.kernels.deltanet_gates import gate_project
            from engine.kernels.gated_rope import gated_rope_write as gated_rope
        else:
            from engine.kernels.deltanet_decode import conv_update_reference as conv_update
            from engine.kernels.deltanet_decode import recurrent_update_reference as recurrent_update
            from engine.kernels.deltanet_gates import gate_project_reference as gate_project
            from engine.kernels.gated_rope import gated_rope_write_reference as gated_rope
        self.conv_update, self.recurrent_update, self.gated_rope = conv_update, recurrent_update, gated_rope
        self.gate_project = gate_project


def _project(ops: _Ops, x: torch.Tensor | tuple, layer: torch.nn.Module, norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, gated: bool = False, residual: torch.Tensor | None = None,
             tied_weight: torch.Tensor | None = None, into: torch.Tensor | None = None,
             rotation: InputRotation | None = None, zero: torch.Tensor | None = None,
             swiglu_in_product: bool = False) -> torch.Tensor:
    """norm/SwiGLU (optional) → rotation (optional) → projection, added into `residual` (or a zeroed
    workspace buffer `into`) in place when given. Returns the float32 result [M, N]. A gated input of a
    packed layer is the gate/up workspace buffer: it is zeroed as it is read (not with a rotation: the
    caller zeroes it). zero: a buffer to zero once the kernels before are done (in the product's kernel where it
    takes its float row); swiglu_in_product: a gated input goes to the product as it is (cuda_swiglu_gemv), not
    zeroed."""
    if rotation is not None:  # the norm in torch, then the rotation: never quantize the unrotated input
        assert not gated and not isinstance(x, tuple), "a rotated input is made by the caller"
        if norm_weight is not None:
            x = F.rms_norm(x.float(), norm_weight.shape, norm_weight.float(), eps)  # [M, K]
        x, norm_weight = rotation(x), None  # [M, K]
    fused_norm = (isinstance(layer, PackedLinear) and not isinstance(x, tuple) and norm_weight is not None
                  and not gated and ops.norm_gemv_takes(x, norm_weight, layer.packed))
    if zero is not None and not fused_norm:
        zero.zero_()  # a memset in stream order where no fused kernel does it
    if isinstance(layer, PackedLinear):
        target = residual if residual is not None else into
        if isinstance(x, tuple):  # already int8 activations (xq, sx, sumx)
            y = ops.gemv(*x, layer.packed, out=target, accumulate=target is not None)
        elif fused_norm:  # one launch: the CUDA C++ product normalizes, quantizes its groups (quant.kernels.cuda_gemv)
            y = ops.norm_gemv(x, norm_weight, eps, layer.packed, out=target, accumulate=target is not None, zero=zero)
        elif gated and swiglu_in_product:
            y = ops.swiglu_gemv(x, layer.packed, out=target, accumulate=target is not None)
        else:
            xq = ops.quantize(x, layer.group_size, norm_weight, eps, gated=gated, zero_input=gated)
            y = ops.gemv(*xq, layer.packed, out=target, accumulate=target is not None)
        if layer.bias is not None:
            y += layer.bias.float()
        return y
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm_weight is not None:
        x = F.rms_norm(x, norm_weight.shape, norm_weight.float(), eps)
    weight = tied_weight if layer is None else layer.weight
    y = F.linear(x.to(weight.dtype), weight, None if layer is None else layer.bias).float()  # [M, N]
    if residual is not None:
        residual += y
        return residual
    return y


def decode_step(model: Transformer, cache: KVCache, inputs: StepInputs, ops: _Ops, num_splits: int,
                ws: Workspace) -> torch.Tensor:
    """Logits float32 [M, V] for one token per row; K/V of the rows are written to the cache.
    A pipeline stage (engine.pipeline) runs its own blocks: from the previous stage's residual stream
    (inputs.hidden) unless it takes tokens, to its residual stream [M, H] unless it gives logits."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    stream = model.weight_stream  # weight offload: blocks' weights streamed in (graphed: engine.memory.weight_offload)
    if stream is not None:
        stream.begin_pass()
    if not model.takes_tokens:  # a later pipeline stage: the previous stage's residual stream
        x = inputs.hidden.clone()  # [M, H]
    else:
        rows = inputs.embedded if inputs.embedded is not None else model.embed(inputs.tokens)  # [M, H]
        x = rows.to(torch.float32, copy=True)  # [M, H] residual stream (never the static input buffer itself)
    scale = cfg.head_dim ** -0.5
    fused_swiglu = ws.swiglu_in_down and ops.fast
    for i, block in enumerate(model.layers):
        if stream is not None:
            stream.enter(i)
        att = block.attention
        if cfg.hybrid is not None:  # engine.runtime.hybrid_step: DeltaNet or gated attention, then the FFN below
            if cfg.is_linear(i + model.first_layer):
                deltanet_step(ops, _project, block, x, cache.states, inputs, eps)
            else:
                gated_attention_step(ops, _project, model, block, cache, x, inputs, num_splits, eps)
            _feed_forward(ops, block, x, ws, eps)
            continue
        qkv = _project(ops, x, att.wqkv, block.attention_norm.weight, eps, into=ws.qkv, rotation=att.wqkv_rotation,
                       zero=ws.gate_up if fused_swiglu else None)  # [M, Q + 2KV]
        kv = cache.layer(i)  # {name: [slots, KV, S, D]} (KV offload: the layer's streamed-in rows)
        q_norm = att.q_norm.weight if att.q_norm is not None else None
        k_norm = att.k_norm.weight if att.k_norm is not None else None
        if ws.attention is not None and ops.fast:  # norm, rotary, K/V write, attention, int8: one launch
            args = (qkv, inputs.positions, inputs.slot_ids, model.inv_freq, kv["k"], kv["v"], cfg.num_heads,
                    cfg.num_kv_heads, cfg.head_dim, q_norm, k_norm, eps, scale, ws.attention)
            if ws.attention.combine:
                aq = ops.rope_attention(*args, zero_input=qkv is ws.qkv)  # int8 [1, H * D], [1, H], [1, H]
                _project(ops, aq, att.wo, residual=x)
            else:  # o_proj's product combines the splits' partials [KV, S, GP, D], [KV, S, GP, 2] and zeroes qkv
                part, ml = ops.rope_attention_partials(*args)
                ops.splits_gemv(part, ml, cfg.num_heads // cfg.num_kv_heads, kv["k"].dtype, att.wo.packed, out=x,
                                accumulate=True, zero=ws.qkv if qkv is ws.qkv else None)
            _feed_forward(ops, block, x, ws, eps)
            continue
        scales = cache.layer_read_args(i)  # a quantized cache's scale / min tensors, v_rotate (none for bf16)
        q = ops.rope_write(qkv, inputs.positions, inputs.slot_ids, model.inv_freq, kv["k"], kv["v"],
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, q_norm, k_norm, eps,
                           out_dtype=cache.dtype, zero_input=qkv is ws.qkv,
                           **cache.layer_write_args(i))  # [M, H, D]
        if isinstance(att.wo, PackedLinear) and att.wo.group_size == cfg.head_dim and att.wo_rotation is None:
            aq = ops.attention_int8(q, kv["k"], kv["v"], inputs.slot_ids, inputs.seq_lens, scale,
                                    num_splits, **scales)  # int8 [M, H * D], scales and sums [M, H]
            _project(ops, aq, att.wo, residual=x)
        else:
            a = ops.attention(q, kv["k"], kv["v"], inputs.slot_ids, inputs.seq_lens, scale,
                              num_splits, **scales)  # [M, H, D]
            _project(ops, a.reshape(a.shape[0], cfg.q_size), att.wo, residual=x, rotation=att.wo_rotation)
        _feed_forward(ops, block, x, ws, eps)
    if not model.gives_logits:
        return x  # [M, H] float32: the next stage's input
    ws.hidden.copy_(x)  # [M, H] (one small copy a step)
    head = model.lm_head
    return _project(ops, x, head, model.norm.weight, eps, tied_weight=model.embed.weight if head is None else None,
                    rotation=model.lm_head_rotation)  # [M, V]


def _feed_forward(ops: _Ops, block, x: torch.Tensor, ws: Workspace, eps: float) -> None:
    """x [M, H] float32 += the block's SwiGLU FFN (RMSNorm → gate/up → down): one persistent launch where the
    workspace has its buffers and the layers take it (quant.kernels.persistent_ffn), else four launches."""
    ffn = block.feed_forward
    if ws.ffn is not None and ops.fast and _one_launch_ffn(ffn, x):
        from quant.kernels.persistent_ffn import persistent_ffn
        persistent_ffn(x, block.ffn_norm.weight, eps, ffn.w13.packed, ffn.w2.packed, ws.ffn)
        return
    gu = _project(ops, x, ffn.w13, block.ffn_norm.weight, eps, into=ws.gate_up,
                  rotation=ffn.w13_rotation)  # [M, 2F]
    if ffn.w2_rotation is not None:  # w2's weight holds a folded rotation: SwiGLU and the rotation in torch, then w2
        gate, up = gu.chunk(2, dim=-1)
        z = ffn.w2_rotation(F.silu(gate) * up)  # [M, F]
        if gu is ws.gate_up:
            gu.zero_()  # the split-K workspace starts the next step at zero
        _project(ops, z, ffn.w2, residual=x)
    else:
        _project(ops, gu, ffn.w2, gated=True, residual=x, swiglu_in_product=ws.swiglu_in_down and ops.fast)


def _one_launch_ffn(ffn, x: torch.Tensor) -> bool:
    if x.shape[0] != 1 or ffn.w13_rotation is not None or ffn.w2_rotation is not None:
        return False
    if not (isinstance(ffn.w13, PackedLinear) and isinstance(ffn.w2, PackedLinear)):
        return False
    from quant.kernels.persistent_ffn import supported
    return ffn.w13.bias is None and ffn.w2.bias is None and supported(ffn.w13.packed, ffn.w2.packed)


def make_ops(device: torch.device, kernels: bool | None = None) -> _Ops:
    """The Triton kernels (default on CUDA; on the CPU only under TRITON_INTERPRET) or the references."""
    return _Ops(device, kernels)

