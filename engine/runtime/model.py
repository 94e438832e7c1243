"""The transformer (Llama / Qwen2 / Qwen3 family) in one file, gpt-fast style.

Built on the meta device and materialized tensor by tensor (`load_tensor`), so loading holds about
one copy of the weights. q/k/v and gate/up are fused into one matmul each.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels import kernels_usable
from engine.runtime.deltanet import GatedDeltaNet
from engine.runtime.input_rotation import InputRotation, rotated
from engine.runtime.cpu_attention import EXACT_ROWS, rowwise_attention
from engine.runtime.linear import Linear, linear
from engine.runtime.kv_cache import CacheBatch, KVCache
from engine.sources.model_config import ModelConfig
from engine.sources.prism_rotation import InputRotationSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or (x.is_cuda and self.weight.dtype == x.dtype):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # CUDA: float32 maths inside
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg  # layer: its KV cache layer
        self.gated = cfg.hybrid is not None  # q_proj also yields an output gate per head (sigmoid on the output)
        self.wqkv = Linear(cfg.hidden_size, cfg.q_rows + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.wo = Linear(cfg.q_size, cfg.hidden_size)
        self.wqkv_rotation: InputRotation | None = None  # the rotations of folded weights' inputs (input_rotation)
        self.wo_rotation: InputRotation | None = None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.fused_prologue: torch.Tensor | None = None  # inv_freq when q/k-norm + rotary + KV write run fused

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_gate: bool = False) -> tuple:
        """q [B, H, T, D], k and v [B, KV, T, D] of x [B, T, hidden]: projection, q/k norms, rotary
        (with_gate: and the output gate [B, T, H*D] of a gated attention)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.wqkv(rotated(self.wqkv_rotation, x)).split([cfg.q_rows, cfg.kv_size, cfg.kv_size], dim=-1)
        gate = None
        if self.gated:  # per head: D query values, then D gate values
            q, gate = q.view(b, t, cfg.num_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, cfg.q_size)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)  # [B, T, H, D]
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim)  # [B, T, KV, D]
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)  # [B, T, KV, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin).transpose(1, 2)  # [B, H, T, D]
        k = apply_rotary(k, cos, sin).transpose(1, 2)  # [B, KV, T, D]
        return (q, k, v.transpose(1, 2), gate) if with_gate else (q, k, v.transpose(1, 2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: CacheBatch, kv_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        if self.fused_prologue is not None:
            q, gate = self._fused_prologue(x, cache, batch), None  # [B, H, T, D]; K/V written, q in the keys' space
        else:
            q, k, v, gate = self.project(x, cos, sin, with_gate=True)
            cache.write(self.layer, batch, k, v)
            q = cache.key_space(q)  # [B, H, T, D] rotated where the stored keys are
        if cache.kv_type.quantized:  # read the codes of the positions in use, causal by position
            kernel = self.fused_prologue is not None or kernels_usable(q.device)
            out = quantized_cache_attention(q, cache, self.layer, batch, kernel)  # [B, H, T, D]
        else:
            keys, values = cache.read(self.layer, batch, kv_len)  # [B, KV, S, D]
            causal = mask is None and t > 1  # a fresh single sequence: the flash kernel's own causal mask
            out = attention(q, keys, values, mask, causal, cfg.num_heads != cfg.num_kv_heads)  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(b, t, cfg.q_size)  # [B, T, H*D]
        if self.gated:
            out = out * torch.sigmoid(gate.float()).to(out.dtype)
        return self.wo(rotated(self.wo_rotation, out))

    def _fused_prologue(self, x: torch.Tensor, cache: KVCache, batch: CacheBatch) -> torch.Tensor:
        """The projection, then one kernel for q/k norms, rotary and the K/V write (fewer launches
        than `project` + `cache.write`: prefill on a GPU is otherwise bound by the host)."""
        from engine.kernels.rope_cache import qk_norm_rope_write
        cfg = self.cfg
        b, t, _ = x.shape
        qkv = self.wqkv(rotated(self.wqkv_rotation, x)).reshape(b * t, -1)  # [B*T, Q + 2KV]
        kv = cache.layer(self.layer)  # {name: [slots, KV, S, D]}
        q = qk_norm_rope_write(qkv, batch.positions.reshape(-1), batch.slot_ids.repeat_interleave(t),
                               self.fused_prologue, kv["k"], kv["v"], cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, self.q_norm.weight if self.q_norm else None,
                               self.k_norm.weight if self.k_norm else None, cfg.rms_norm_eps,
                               out_dtype=x.dtype, **cache.layer_write_args(self.layer))  # [B*T, H, D]
        return q.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)  # gate; up
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.w13_rotation: InputRotation | None = None  # the rotations of folded weights' inputs (input_rotation)
        self.w2_rotation: InputRotation | None = None

    @property
    def down_hadamard(self) -> int:
        """The block of the rotation on w2's input (an online Hadamard), 0 without one."""
        return 0 if self.w2_rotation is None else self.w2_rotation.block

    def set_down_hadamard(self, block: int, device: torch.device | str) -> None:
        """Apply I ⊗ H_block to the SwiGLU output before w2 (whose weight then holds W·H_block)."""
        assert block and self.intermediate % block == 0, f"block {block} does not divide {self.intermediate}"
        self.w2_rotation = InputRotation(InputRotationSpec(self.intermediate, block), device)

    def down_input(self, x: torch.Tensor, w13: torch.Tensor | None = None) -> torch.Tensor:
        """The input of w2 for x [.., H]: SwiGLU of gate/up (w13's, or the float `w13` [2F, H] calibration keeps),
        then w2's input rotation if any → [.., F]."""
        h = rotated(self.w13_rotation, x)  # [.., H]
        gate, up = (self.w13(h) if w13 is None else F.linear(h, w13)).split(self.intermediate, dim=-1)
        return rotated(self.w2_rotation, F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.down_input(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.native = None  # on the native CPU kernels, the block's rows in one C call (engine.runtime.cpu_step)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        index = cfg.hybrid.state_index(layer) if cfg.hybrid else layer  # its KV layer, or DeltaNet state
        self.attention = GatedDeltaNet(cfg, index) if cfg.is_linear(layer) else Attention(cfg, index)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, cache, batch, kv_len, mask):
        if self.native is not None and (out := self.native(x, cos, sin, cache, batch)) is not None:
            return out
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, batch, kv_len, mask)
        return x + self.feed_forward(self.ffn_norm(x))


# cuDNN's attention builds an execution plan for every new sequence length (~1 s each on an H200:
# it showed as 1.2-1.5 s first-token times of new prompt lengths in the server); flash/efficient don't.
_GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# A masked attention (a prefill chunk after the first) on a GPU runs in query blocks whose float32
# scores [H, rows, S] stay under this: PyTorch may run it in its math backend, which materializes them
# (at a 32K context a 512-token chunk's scores alone would be 2.7 GB for 40 heads).
ATTENTION_SCORE_BYTES = 128 << 20


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              gqa: bool) -> torch.Tensor:
    """softmax(q kᵀ/√D + mask) v: q [B, H, T, D], k/v [B, KV, S, D] → [B, H, T, D]."""
    if q.is_cuda:
        with sdpa_kernel(_GPU_ATTENTION_BACKENDS):
            if mask is not None:
                return blocked_attention(q, k, v, mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    if mask is not None and q.shape[0] * q.shape[2] <= EXACT_ROWS:  # a verify pass: the decode step's values
        exact = rowwise_attention(q, k, v, mask, gqa)
        if exact is not None:
            return exact
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def attention_block_rows(num_heads: int, kv_len: int, rows: int) -> int:
    """Query rows per call of `blocked_attention`: float32 scores of at most ATTENTION_SCORE_BYTES."""
    return max(1, min(rows, ATTENTION_SCORE_BYTES // (num_heads * kv_len * 4)))


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention with grouped-query heads folded into the query axis (each KV head serves
    its g query heads as g·T query rows: K/V are never repeated per query head) and the queries in
    blocks of `attention_block_rows`: q [B, H, T, D], k/v [B, KV, S, D], mask [B, 1, T, S] bool → [B, H, T, D]."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    out = torch.empty_like(q)  # [B, H, T, D]
    step = attention_block_rows(h, s, t)
    for t0 in range(0, t, step):
        t1 = min(t0 + step, t)
        qb = q[:, :, t0:t1].reshape(b, kv, g * (t1 - t0), d)  # [B, KV, g·rows, D]
        mb = mask[:, :, t0:t1].repeat(1, 1, g, 1)  # [B, 1, g·rows, S]
        ob = F.scaled_dot_product_attention(qb, k, v, attn_mask=mb)  # [B, KV, g·rows, D]
        out[:, :, t0:t1] = ob.reshape(b, h, t1 - t0, d)  # the output may come back strided
    return out


def quantized_cache_attention(q: torch.Tensor, cache: KVCache, layer: int, batch: CacheBatch,
                              kernel: bool) -> torch.Tensor:
    """Attention of q [B, H, T, D] (in the cache's key space, KVCache.key_space) over a quantized cache
    whose layer already holds the T new rows of each sequence: query t of row b attends to positions
    0..starts[b] + t; rotated values are rotated back. kernel: the prefill kernel reads the codes tile by
    tile (on CUDA; where the fused prologue runs); else (or for shapes it does not take) its reference
    dequantizes the positions in use, and only those."""
    from engine.kernels import UnsupportedKernelShape
    from engine.kernels.attention_prefill import prefill_attention_reference
    kv = cache.layer(layer)  # {name: [slots, KV, S, X]}
    scales = cache.layer_read_args(layer)  # scale / min tensors, v_rotate
    starts = batch.positions[:, 0]  # [B]
    args = (q, kv["k"], kv["v"], batch.slot_ids, starts, q.shape[-1] ** -0.5)
    if kernel:
        from engine.kernels.attention_prefill import prefill_attention
        try:
            return prefill_attention(*args, **scales)
        except UnsupportedKernelShape:
            pass
    return prefill_attention_reference(*args, **scales)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX / HF) rotary: x [B, T, H, D], cos/sin [B, T, 1, R/2]; a partial rotary (R < D)
    turns the first R of each head's D elements and passes the rest."""
    r = 2 * cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_inverse_frequencies(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[D/2] inverse frequencies, with linear / llama3 scaling or GGUF `rope_freqs` factors."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    elif rs is not None and rs.kind == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.kind == "llama3":
        wavelen = 2 * math.pi / inv
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (1 - smooth) * inv / rs.factor + smooth * inv
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # given weights skip nn.Embedding's random init (on the meta device it costs seconds of imports)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head_rotation: InputRotation | None = None  # a folded output layer's input rotation
        self.register_buffer("inv_freq", rotary_inverse_frequencies(cfg), persistent=False)
        # weight offload (engine.memory.weight_offload): streams offloaded blocks' weights in before each block
        self.weight_stream = None
        # a pipeline stage (engine.pipeline) holds blocks first_layer.. only; its input is token ids
        # (the embedding) or the previous stage's hidden states, its output logits or hidden states
        self.first_layer = 0
        self.takes_tokens = True
        self.gives_logits = True

    def keep_layers(self, first: int, end: int, takes_tokens: bool, gives_logits: bool) -> None:
        """Make this (still unmaterialized) model one pipeline stage: blocks first..end-1, whose
        attention reads a KV cache of their own (the stage's attention layers in order; a hybrid's DeltaNet
        layers likewise their states)."""
        self.layers = nn.ModuleList(list(self.layers)[first:end])
        hybrid = self.config.hybrid
        kinds = hybrid.layer_types[first:end] if hybrid else ("full_attention",) * len(self.layers)
        for i, block in enumerate(self.layers):  # its place among the stage's layers of its kind
            index = sum(k == kinds[i] for k in kinds[:i])
            if isinstance(block.attention, Attention):
                block.attention.layer = index
            else:  # a hybrid's DeltaNet layer: its state in the stage's HybridStates
                block.attention.index = index
        self.first_layer, self.takes_tokens, self.gives_logits = first, takes_tokens, gives_logits

    def use_fused_prologue(self, on: bool) -> None:
        """Run each layer's q/k-norm + rotary + KV write as one kernel (engine.kernels.rope_cache)."""
        for block in self.layers:
            block.attention.fused_prologue = self.inv_freq if on else None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer: the tied embedding, or lm_head (a Linear or a PackedLinear)."""
        x = rotated(self.lm_head_rotation, x)
        return linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)

    def forward(self, tokens: torch.Tensor, batch: CacheBatch, cache: KVCache, kv_len: int,
                num_logits: int | None = 1) -> torch.Tensor:
        """tokens [B, T] written to the cache where `batch` says; attention reads the first kv_len
        positions of each row's slot. Returns logits [B, n, V] of the last n positions (all if None)."""
        return self.forward_hidden(tokens, batch, cache, kv_len, num_logits)[0]

    def forward_hidden(self, tokens: torch.Tensor, batch: CacheBatch, cache: KVCache, kv_len: int,
                       num_logits: int | None = 1, hidden_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward`, plus the residual stream after each block in `hidden_layers` (layer index
        i: the output of block i, before any norm; -1: the last block): {i: [B, T, hidden]}.
        A pipeline stage takes hidden states [B, T, H] instead of tokens unless it `takes_tokens`,
        and returns its blocks' output [B, T, H] instead of logits unless it `gives_logits`."""
        positions = batch.positions  # [B, T]
        b, t = positions.shape
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]  # [B, T, 1, D/2]
        mask = None
        fresh = b == 1 and batch.starts[0] == 0 and kv_len == t
        if (t > 1 or b > 1) and not fresh:
            key_pos = torch.arange(kv_len, device=tokens.device)
            mask = key_pos[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        wanted = {i % self.config.num_layers - self.first_layer: i for i in hidden_layers}
        hidden: dict[int, torch.Tensor] = {}
        if cache.streamed:  # KV offload: the positions this pass reads and writes, per slot
            cache.begin_pass(batch.slots, batch.starts, [start + t for start in batch.starts])
        stream = self.weight_stream
        if stream is not None:
            stream.begin_pass()
        x = self.embed(tokens).to(self.norm.weight.dtype) if self.takes_tokens else tokens  # [B, T, H] (norm: meta off the last stage, its dtype still right)
        for i, block in enumerate(self.layers):
            if stream is not None:
                stream.enter(i)
            x = block(x, cos, sin, cache, batch, kv_len, mask)
            if i in wanted:
                hidden[wanted[i]] = x
        if not self.gives_logits:
            return x, hidden  # [B, T, H]: the next stage's input
        if num_logits is not None:
            x = x[:, -num_logits:]
        return self.output(self.norm(x)).float(), hidden  # [B, n, V], {i: [B, T, H]}

    @torch.no_grad()
    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one canonical-named tensor (engine.sources.gguf_file) into its (possibly fused) parameter."""
        cfg = self.config
        if name == "rope_freqs":
            self.inv_freq.copy_(rotary_inverse_frequencies(cfg, tensor))
            return
        parts = name.split(".")
        if cfg.hybrid is not None and (name == "norm.weight" or parts[-2] in _CENTRED_NORMS):
            tensor = tensor.float() + 1  # Qwen3.5 stores these RMSNorm weights minus one: x·(1 + w)
        if parts[0] != "layers":
            target = {"embed_tokens.weight": self.embed.weight, "norm.weight": self.norm.weight,
                      "lm_head.weight": getattr(self.lm_head, "weight", None)}.get(name)
            if target is None:
                if name == "lm_head.weight":
                    return  # tied checkpoints sometimes ship a copy of the embedding
                raise KeyError(name)
            _copy_into(target, tensor, name)
            return
        block: Block = self.layers[int(parts[1]) - self.first_layer]
        part, kind = parts[2], parts[3]
        qkv_rows = {"q_proj": (0, cfg.q_rows), "k_proj": (cfg.q_rows, cfg.kv_size),
                    "v_proj": (cfg.q_rows + cfg.kv_size, cfg.kv_size)}
        if isinstance(block.attention, GatedDeltaNet) and part not in _BLOCK_PARTS:
            target = block.attention.parameter_of(part)
            if target is None:
                raise KeyError(name)
            _copy_into(target, tensor.reshape(target.shape) if part == "conv1d" else tensor, name)
        elif part in qkv_rows:
            start, rows = qkv_rows[part]
            param = block.attention.wqkv.weight if kind == "weight" else block.attention.wqkv.bias
            _copy_into(param[start:start + rows], tensor, name)
        elif part in ("gate_proj", "up_proj"):
            start = 0 if part == "gate_proj" else cfg.intermediate_size
            _copy_into(block.feed_forward.w13.weight[start:start + cfg.intermediate_size], tensor, name)
        else:
            # a layer being packed while loading is a PackedLinear here (engine.weights.loader), without .weight
            attn = block.attention
            target = {"o_proj": getattr(getattr(attn, "wo", None), "weight", None),
                      "down_proj": getattr(block.feed_forward.w2, "weight", None),
                      "input_layernorm": block.attention_norm.weight,
                      "post_attention_layernorm": block.ffn_norm.weight,
                      "q_norm": attn.q_norm.weight if getattr(attn, "q_norm", None) else None,
                      "k_norm": attn.k_norm.weight if getattr(attn, "k_norm", None) else None}.get(part)
            if target is None:
                raise KeyError(name)
            _copy_into(target, tensor, name)


_CENTRED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
_BLOCK_PARTS = ("input_layernorm", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")


def _copy_into(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"tensor {name} has shape {tuple(source.shape)}, the model expects {tuple(target.shape)}")
    target.copy_(source)
