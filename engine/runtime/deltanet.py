"""Gated DeltaNet (Qwen3.5 / Qwen3.6 linear-attention layers): plain-torch chunked and recurrent maths,
the causal depthwise conv over q/k/v, and the layer, whose state lives in the slot (engine.runtime.hybrid_state).

Per head (value head h, its key head h // (Hv / Hk)), with q, k L2-normalized and q scaled by 1/√Dk:
    S ← exp(g) · S;  S ← S + k ⊗ β (v − Sᵀk);  o = Sᵀ q          S: [Dk, Dv] float32
The chunked form computes the same thing a chunk of C positions at a time (a triangular solve per chunk).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import kernels_usable
from engine.kernels.deltanet_ref import _gated_norm, causal_conv  # noqa: F401 (the layer's torch maths)
from engine.runtime.linear import Linear
from engine.sources.model_config import ModelConfig


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _heads_first(q, k, v, g, beta, groups: int):
    """[B, T, H*, D] inputs → float32 [B, Hv, T, D] (key heads repeated per value head), q/k normalized, q scaled."""
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    return _l2norm(q) * q.shape[-1] ** -0.5, _l2norm(k), v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, keep_states: bool = False):
    """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g (log decay ≤ 0), beta [B, T, Hv]; state float32 [B, Hv, Dk, Dv].
    Returns out [B, T, Hv, Dv] float32, the final state, and (keep_states) every state [B, T+1, Hv, Dk, Dv]
    (index j: after j of the T tokens)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2] // k.shape[2])
    s = state.float()
    out = torch.empty_like(v)  # [B, Hv, T, Dv]
    kept = [s] if keep_states else []
    for t in range(v.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]  # [B, Hv, Dv]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(-2)
        if keep_states:
            kept.append(s)
    states = torch.stack(kept, dim=1) if keep_states else None
    return out.transpose(1, 2), s, states  # [B, T, Hv, Dv] float32


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """The recurrence a chunk of `chunk` positions at a time (same arguments; returns out, final state)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2] // k.shape[2])
    b, h, t, dv = v.shape
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [B, H, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0)  # strictly lower: unit-triangular solve
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device)
    new_v = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system + eye, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    s = state.float()
    out = torch.empty_like(v)  # [B, H, N, C, Dv]
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ s
        out[:, :, i] = q_dec[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.transpose(1, 2), s


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `index` is its place among the model's DeltaNet layers (its state)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        hc = cfg.hybrid
        self.hc, self.index, self.eps = hc, index, cfg.rms_norm_eps
        self.in_proj_qkv = Linear(cfg.hidden_size, hc.conv_dim)
        self.in_proj_z = Linear(cfg.hidden_size, hc.value_dim)
        self.in_proj_b = Linear(cfg.hidden_size, hc.linear_num_value_heads)
        self.in_proj_a = Linear(cfg.hidden_size, hc.linear_num_value_heads)
        self.out_proj = Linear(hc.value_dim, cfg.hidden_size)
        self.conv_weight = nn.Parameter(torch.empty(hc.conv_dim, hc.conv_kernel))  # [C, K]
        self.dt_bias = nn.Parameter(torch.empty(hc.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.empty(hc.linear_num_value_heads))
        self.norm_weight = nn.Parameter(torch.empty(hc.linear_value_head_dim))
        self.chunk = 64  # positions per chunk of the chunked prefill maths

    def join_gates(self) -> None:
        """in_proj_b and in_proj_a as one float matrix `gates` [2·Hv, H] (b's rows, then a's) whose halves become
        those layers' weights (views: no second copy), so the fused decode step projects both in one matmul."""
        b, a = self.in_proj_b.weight, self.in_proj_a.weight
        if b.is_meta or a.is_meta or b.dtype != a.dtype or b.device != a.device:
            return
        both = torch.cat([b.detach(), a.detach()])  # [2·Hv, H]
        self.in_proj_b.weight = nn.Parameter(both[:b.shape[0]], requires_grad=False)
        self.in_proj_a.weight = nn.Parameter(both[b.shape[0]:], requires_grad=False)
        self.gates = both

    def parameter_of(self, part: str) -> torch.Tensor | None:
        """The tensor a canonical part name (engine.sources.hf_files) loads into; None: unknown."""
        if part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            return getattr(getattr(self, part), "weight", None)
        return {"conv1d": self.conv_weight, "dt_bias": self.dt_bias, "A_log": self.A_log,
                "linear_norm": self.norm_weight}.get(part)

    def forward(self, x, cos, sin, cache, batch, kv_len, mask) -> torch.Tensor:
        b, t, _ = x.shape
        states = cache.states
        conv_in, z, beta, g = self._inputs(x)
        window, rec = states.read(self.index, batch)  # [B, C, K-1], [B, Hv, Dk, Dv] (zeros where a row starts at 0)
        # a verify pass keeps every position's state and window (all of `seen`), for a rollback by copy
        mixed, seen = self._conv(conv_in, window, keep_all=states.recording)  # [B, T, C], [B, C, ≥ K-1]
        q, k, v = self._split(mixed, b, t)  # [B, T, Hk, Dk] x2, [B, T, Hv, Dv]
        kept = None
        if states.recording:
            out, rec, kept = recurrent_gated_delta_rule(q, k, v, g, beta, rec, keep_states=True)
        elif t == 1:
            out, rec, _ = recurrent_gated_delta_rule(q, k, v, g, beta, rec)
        else:
            out, rec = self._chunked(q, k, v, g, beta, rec)
        states.write(self.index, batch, seen, rec, kept)
        return self._output(out, z, x.dtype)

    @staticmethod
    def _kernels(t: torch.Tensor) -> bool:
        """The Triton kernels where they run; they have no backward, so a pass recording gradients (scale tuning:
        engine.quantization.scale_tuning) takes the torch maths."""
        return kernels_usable(t.device) and not torch.is_grad_enabled()

    def over_sequences(self, x: torch.Tensor, project: bool = True) -> torch.Tensor:
        """The layer over whole sequences x [B, T, hidden] from the zero state, no cache (calibration); project
        False: out_proj's input [B, T, value_dim], the gated-normed rule output."""
        hc = self.hc
        b, t, _ = x.shape
        conv_in, z, beta, g = self._inputs(x)
        mixed, _ = self._conv(conv_in, conv_in.new_zeros(b, hc.conv_dim, hc.conv_kernel - 1))
        q, k, v = self._split(mixed, b, t)
        state = x.new_zeros(b, hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim,
                            dtype=torch.float32)
        out, _ = self._chunked(q, k, v, g, beta, state)
        return self._output(out, z, x.dtype, project)

    def _conv(self, conv_in: torch.Tensor, window: torch.Tensor, keep_all: bool = False):
        """The causal conv + SiLU of conv_in [B, C, T] after window → [B, T, C] and what the window becomes (its
        last K-1 columns; keep_all: every input seen [B, C, K-1+T]). One kernel where the kernels run
        (engine.kernels.deltanet_layer: its output's heads are contiguous for the chunked rule), else torch."""
        if self._kernels(conv_in) and not keep_all:
            from engine.kernels import UnsupportedKernelShape
            from engine.kernels.deltanet_layer import causal_conv as conv_kernel
            try:
                return conv_kernel(conv_in.transpose(1, 2), window, self.conv_weight)
            except UnsupportedKernelShape:
                pass
        mixed, seen = causal_conv(conv_in, window, self.conv_weight)
        return mixed.transpose(1, 2), seen

    def _chunked(self, q, k, v, g, beta, state):
        """The chunked rule: the Triton kernels where they run (engine.kernels.deltanet_prefill: any strides but a
        contiguous last dim), else the torch maths."""
        if self._kernels(q):
            from engine.kernels import UnsupportedKernelShape
            from engine.kernels.deltanet_prefill import chunk_gated_delta_rule_triton
            q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
            try:
                return chunk_gated_delta_rule_triton(q, k, v, g.contiguous(), beta.contiguous(), state.contiguous())
            except UnsupportedKernelShape:
                pass
        return chunk_gated_delta_rule(q, k, v, g, beta, state, self.chunk)

    def _inputs(self, x: torch.Tensor):
        """The conv input [B, C, T], output gate z [B, T, Hv, Dv], beta and log decay g [B, T, Hv] of x."""
        hc = self.hc
        b, t, _ = x.shape
        conv_in = self.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        z = self.in_proj_z(x).view(b, t, hc.linear_num_value_heads, hc.linear_value_head_dim)  # [B, T, Hv, Dv]
        beta = self.in_proj_b(x).float().sigmoid()  # [B, T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # [B, T, Hv]
        return conv_in, z, beta, g

    def _split(self, mixed: torch.Tensor, b: int, t: int):
        """q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv] of the conv output [B, T, C] (views)."""
        hc = self.hc
        q, k, v = mixed.split([hc.key_dim, hc.key_dim, hc.value_dim], dim=-1)
        return (q.reshape(b, t, hc.linear_num_key_heads, hc.linear_key_head_dim),
                k.reshape(b, t, hc.linear_num_key_heads, hc.linear_key_head_dim),
                v.reshape(b, t, hc.linear_num_value_heads, hc.linear_value_head_dim))

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype, project: bool = True) -> torch.Tensor:
        b, t = out.shape[:2]
        normed = None
        if self._kernels(out):  # the gated norm in one kernel (engine.kernels.deltanet_layer)
            from engine.kernels import UnsupportedKernelShape
            from engine.kernels.deltanet_layer import gated_rms_norm
            try:
                normed = gated_rms_norm(out, z, self.norm_weight, self.eps)  # [B, T, Hv, Dv] in z's dtype
            except UnsupportedKernelShape:
                pass
        if normed is None:
            normed = _gated_norm(out, z, self.norm_weight, self.eps)
        normed = normed.reshape(b, t, self.hc.value_dim).to(dtype)  # [B, T, Hv * Dv]
        return self.out_proj(normed) if project else normed
