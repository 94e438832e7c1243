"""The mixer half of a hybrid block (Qwen3.5 / Qwen3.6) inside the fused decode step (engine.runtime.decode_step):
one token per row, each row a distinct slot or (a verify) rows of one slot in runs at consecutive positions, the
residual stream x [M, H] float32 added to in place.

- Gated DeltaNet: the projections through the step's GEMV (q/k/v and the output gate z share one int8
  activation quantization when both are packed; in_proj_a / in_proj_b are float), the conv window and the
  recurrent state updated in place in the slot's buffers (HybridStates.conv / .recurrent, addressed by slot
  index: engine.kernels.deltanet_decode, whose recurrent kernel also makes the gates and the gated RMSNorm),
  out_proj into x.
- Gated attention: q/k norms, the partial rotary and the K/V write in one kernel (engine.kernels.gated_rope: the
  dense models' rope/KV-write kernel rotates whole heads; a quantized cache's rows quantized as they are
  written, q rotated into the keys' space), the decode attention kernel (on the codes), the sigmoid output gate,
  o_proj into x.
Nothing here reads a device value on the host or indexes with a host list: the step stays capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.runtime.deltanet import GatedDeltaNet
from engine.weights.packed_linear import PackedLinear


def deltanet_step(ops, project, block, x: torch.Tensor, states, inputs, eps: float) -> None:
    """x [M, H] float32 += the DeltaNet layer of `block` for one token per row (its slot's state updated; rows of
    one slot in runs, inputs.run_len, step it in order, the state after each kept where inputs.snap_idx says)."""
    slot_ids, positions = inputs.slot_ids, inputs.positions
    runs = {} if inputs.run_len is None else dict(run_len=inputs.run_len, snap_idx=inputs.snap_idx)
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
    gates = getattr(att, "gates", None)  # in_proj_b and in_proj_a joined (join_gates): one matmul
    if gates is not None:  # the input norm and both gate projections in one launch (the norm's float copy)
        b, a = ops.gate_project(x, att.gates_norm, gates, eps).split(hc.linear_num_value_heads, dim=-1)  # [M, Hv] each
    else:
        normed = F.rms_norm(x, norm.shape, norm.float(), eps)  # [M, H] float32, for the two float gate projections
        b, a = project(ops, normed, att.in_proj_b), project(ops, normed, att.in_proj_a)  # [M, Hv] each
    if runs:
        rec_snap, conv_snap = states.row_snapshots(att.index)  # [R, Hv, Dk, Dv], [R, C, K-1]
    mixed = ops.conv_update(conv_in, states.conv[att.index], att.conv_weight, slot_ids, positions,
                            **(runs and {**runs, "snap": conv_snap}))  # [M, C]
    q, k, v = mixed.split([hc.key_dim, hc.key_dim, hc.value_dim], dim=-1)
    heads = (m, hc.linear_num_value_heads, hc.linear_value_head_dim)
    out = ops.recurrent_update(q.view(m, hc.linear_num_key_heads, hc.linear_key_head_dim),
                               k.view(m, hc.linear_num_key_heads, hc.linear_key_head_dim), v.view(heads), a, b,
                               att.A_log, att.dt_bias, z.view(heads), att.norm_weight, eps,
                               states.recurrent[att.index], slot_ids, positions,
                               **(runs and {**runs, "snap": rec_snap}))  # [M, Hv, Dv] float32, gated-normed
    project(ops, out.reshape(m, hc.value_dim), att.out_proj, residual=x)


def gated_attention_step(ops, project, model, block, cache, x: torch.Tensor, inputs, num_splits: int,
                         eps: float) -> None:
    """x [M, H] float32 += the gated attention layer of `block` (its K/V written at the rows' positions)."""
    cfg = model.config
    att = block.attention
    m, d = x.shape[0], cfg.head_dim
    qkv = project(ops, x, att.wqkv, block.attention_norm.weight, eps)  # [M, 2Q + 2KV] float32
    kv = cache.layer(att.layer)  # {name: [slots, KV, S, D]}
    q = ops.gated_rope(qkv, inputs.positions, inputs.slot_ids, model.inv_freq, att.q_norm.weight,
                       att.k_norm.weight, kv["k"], kv["v"], cfg.num_heads, cfg.num_kv_heads, d, eps,
                       out_dtype=cache.dtype, **cache.layer_write_args(att.layer))  # [M, H, D] in the keys' space
    gate = qkv[:, :cfg.q_rows].view(m, cfg.num_heads, 2 * d)[..., d:]  # [M, H, D]: per head, after its queries
    a = ops.attention(q, kv["k"], kv["v"], inputs.slot_ids, inputs.seq_lens, d ** -0.5, num_splits,
                      **cache.layer_read_args(att.layer))  # [M, H, D]
    out = a.float() * torch.sigmoid(gate)  # [M, H, D]
    project(ops, out.reshape(m, cfg.q_size).to(cache.dtype), att.wo, residual=x)


def join_gates(model, streamed=frozenset()) -> None:
    """Every DeltaNet layer's in_proj_b / in_proj_a joined into one matrix, and its input norm's float copy made
    (before the step is captured: no cast of it in every step). Not the `streamed` blocks (weight offload: their
    tensors are views of a staging buffer that holds another block's weights until theirs are copied in; a joined
    copy made now would be of those, and stay): their step projects b and a apart."""
    for i, block in enumerate(model.layers):
        if isinstance(block.attention, GatedDeltaNet) and i not in streamed:
            block.attention.join_gates()
            block.attention.gates_norm = block.attention_norm.weight.detach().float()  # [H]

