"""The mixer half of a hybrid block (Qwen3.5 / Qwen3.6) inside the fused decode step (engine.runtime.decode_step):
one token per row, each row a distinct slot, the residual stream x [M, H] float32 added to in place.

- Gated DeltaNet: the projections through the step's GEMV (q/k/v and the output gate z share one int8
  activation quantization when both are packed; in_proj_a / in_proj_b are float), the conv window and the
  recurrent state updated in place in the slot's buffers (HybridStates.conv / .recurrent, addressed by slot
  index: engine.kernels.deltanet_decode, whose recurrent kernel also makes the gates and the gated RMSNorm),
  out_proj into x.
- Gated attention: q/k norms, the partial rotary and the K/V write in plain torch on device tensors (the fused
  rope/KV-write kernel rotates whole heads and has no output gate), the decode attention kernel, the sigmoid
  output gate, o_proj into x.
Nothing here reads a device value on the host or indexes with a host list: the step stays capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.runtime.model import apply_rotary
from engine.weights.packed_linear import PackedLinear


def deltanet_step(ops, project, block, x: torch.Tensor, states, slot_ids: torch.Tensor,
                  positions: torch.Tensor, eps: float) -> None:
    """x [M, H] float32 += the DeltaNet layer of `block` for one token per row (its slot's state updated)."""
    att = block.attention
    hc = att.hc
    m = x.shape[0]
    norm = block.attention_norm.weight
    qkv_layer, z_layer = att.in_proj_qkv, att.in_proj_z
    shared = (isinstance(qkv_layer, PackedLinear) and isinstance(z_layer, PackedLinear)
              and qkv_layer.group_size == z_layer.group_size)
    if shared:  # one RMSNorm → int8 for both projections
        xq = ops.quantize(x, qkv_layer.group_size, norm, eps)
        conv_in, z = project(ops, xq, qkv_layer), project(ops, xq, z_layer)  # [M, C], [M, Hv*Dv]
    else:
        conv_in, z = project(ops, x, qkv_layer, norm, eps), project(ops, x, z_layer, norm, eps)
    normed = F.rms_norm(x, norm.shape, norm.float(), eps)  # [M, H] float32, for the two float gate projections
    b, a = project(ops, normed, att.in_proj_b), project(ops, normed, att.in_proj_a)  # [M, Hv] each
    mixed = ops.conv_update(conv_in, states.conv[att.index], att.conv_weight, slot_ids, positions)  # [M, C]
    q, k, v = mixed.split([hc.key_dim, hc.key_dim, hc.value_dim], dim=-1)
    heads = (m, hc.linear_num_value_heads, hc.linear_value_head_dim)
    out = ops.recurrent_update(q.view(m, hc.linear_num_key_heads, hc.linear_key_head_dim),
                               k.view(m, hc.linear_num_key_heads, hc.linear_key_head_dim), v.view(heads), a, b,
                               att.A_log, att.dt_bias, z.view(heads), att.norm_weight, eps,
                               states.recurrent[att.index], slot_ids, positions)  # [M, Hv, Dv] float32, gated-normed
    project(ops, out.reshape(m, hc.value_dim), att.out_proj, residual=x)


def rotary_of(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [M, 1, 1, R/2] of the rows' positions (made once a step, shared by its attention layers)."""
    angles = positions[:, None].float() * model.inv_freq  # [M, R/2]
    return angles.cos()[:, None, None], angles.sin()[:, None, None]


def gated_attention_step(ops, project, model, block, cache, x: torch.Tensor, inputs, rotary: tuple,
                         num_splits: int, eps: float) -> None:
    """x [M, H] float32 += the gated attention layer of `block` (its K/V written at the rows' positions);
    rotary: `rotary_of` the rows' positions."""
    cfg = model.config
    att = block.attention
    m = x.shape[0]
    qkv = project(ops, x, att.wqkv, block.attention_norm.weight, eps)  # [M, 2Q + 2KV] float32
    q, k, v = qkv.split([cfg.q_rows, cfg.kv_size, cfg.kv_size], dim=-1)
    q, gate = q.view(m, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)  # [M, H, D] each: per head q, then gate
    dtype = cache.dtype
    q = att.q_norm(q.to(dtype))  # [M, H, D]
    k = att.k_norm(k.reshape(m, cfg.num_kv_heads, cfg.head_dim).to(dtype))  # [M, KV, D]
    cos, sin = rotary  # [M, 1, 1, R/2]
    q = apply_rotary(q[:, None], cos, sin)[:, 0].contiguous()  # [M, H, D]
    k = apply_rotary(k[:, None], cos, sin)[:, 0]  # [M, KV, D]
    kv = cache.layer(att.layer)  # {name: [slots, KV, S, D]}
    rows, at = inputs.slot_ids.long(), inputs.positions.long()
    kv["k"][rows, :, at] = k
    kv["v"][rows, :, at] = v.reshape(m, cfg.num_kv_heads, cfg.head_dim).to(dtype)
    a = ops.attention(q, kv["k"], kv["v"], inputs.slot_ids, inputs.seq_lens, cfg.head_dim ** -0.5,
                      num_splits)  # [M, H, D]
    out = a.float() * torch.sigmoid(gate)  # [M, H, D]
    project(ops, out.reshape(m, cfg.q_size).to(dtype), att.wo, residual=x)
