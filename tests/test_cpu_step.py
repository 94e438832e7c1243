"""A block's rows in one C call (quant/kernels/cpu_kquant_step.h, engine.runtime.cpu_step) against the block's torch
path (engine.runtime.model.Block with `native` off: the plain reference): a Qwen2-shaped block (q/k/v bias, grouped
heads, Q4_K / Q6_K parts) on random stored weights, decode and verify rows, both C bodies, the rows' independence
from the call, the K/V rows written, where it steps aside, and a tiny GGUF decoded greedily either way."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.runtime.cpu_kquant import KQuantCpuLinear
from engine.runtime.cpu_step import NativeBlockStep, StepRows
from engine.runtime.kv_cache import CacheBatch, KVCache
from engine.runtime.model import Block, rotary_inverse_frequencies
from engine.runtime.runner import ModelRunner
from engine.sources.model_config import ModelConfig
from engine.weights.loader import load_model
from quant import kquant_pack
from quant.kernels import cpu_rt
from tests.gguf_tiny import write_tiny_gguf
from tests.test_cpu_kquant import _raw

needs_cc = pytest.mark.skipif(cpu_rt.compiler() is None, reason="no C compiler on this machine")
H, HEADS, KV, D, F = 256, 4, 2, 64, 512


def _cfg(**kw) -> ModelConfig:
    return ModelConfig("qwen2", 100, H, F, 1, HEADS, KV, D, attention_bias=True, **kw)


def _packed(qtype: T, rows: int, cols: int, seed: int, scale: float) -> kquant_pack.Packed:
    raw = _raw(qtype, rows, cols, seed)
    p = kquant_pack.pack(raw, int(qtype), cols)
    meta = p.meta.copy()  # smaller weights (the d of every block): activations stay in a usual range
    d = meta[..., 0:2].copy().view("<f2").astype("f4") * scale
    meta[..., 0:2] = d.astype("<f2").view("u1").reshape(meta[..., 0:2].shape)
    if p.fmt == "q4k":
        dmin = meta[..., 2:4].copy().view("<f2").astype("f4") * scale
        meta[..., 2:4] = dmin.astype("<f2").view("u1").reshape(meta[..., 2:4].shape)
    return kquant_pack.Packed(p.fmt, p.n, p.k, p.kp, p.qs, p.qh, meta)


def _block(cfg: ModelConfig | None = None) -> Block:
    cfg = cfg or _cfg()
    g = torch.Generator().manual_seed(0)
    block = Block(cfg, 0)
    attn, ffn = block.attention, block.feed_forward
    attn.wqkv = KQuantCpuLinear([_packed(T.Q4_K, HEADS * D, H, 1, 0.05), _packed(T.Q4_K, KV * D, H, 2, 0.05),
                                 _packed(T.Q6_K, KV * D, H, 3, 0.05)], torch.randn(HEADS * D + 2 * KV * D, generator=g))
    attn.wo = KQuantCpuLinear([_packed(T.Q4_K, H, HEADS * D, 4, 0.05)])
    ffn.w13 = KQuantCpuLinear([_packed(T.Q4_K, F, H, 5, 0.01), _packed(T.Q4_K, F, H, 6, 0.01)])
    ffn.w2 = KQuantCpuLinear([_packed(T.Q6_K, H, F, 7, 0.01)])
    with torch.no_grad():
        for norm in (block.attention_norm, block.ffn_norm):
            norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
    block.native = NativeBlockStep(block, StepRows(D // 2))
    return block


def _rows(block: Block, cache: KVCache, x: torch.Tensor, slots: list[int], starts: list[int], native: bool):
    """The block on x [B, T, H] at positions starts[b]..starts[b] + T − 1 of slots[b], as forward_hidden calls it."""
    b, t, _ = x.shape
    batch = CacheBatch.make(slots, starts, t, "cpu")
    inv = rotary_inverse_frequencies(block.attention.cfg)
    angles = batch.positions[..., None].float() * inv  # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]  # [B, T, 1, D/2]
    kv_len = max(starts) + t
    key_pos = torch.arange(kv_len)
    mask = None if b == 1 and starts[0] == 0 else key_pos[None, None, None, :] <= batch.positions[:, None, :, None]
    keep, block.native = block.native, (block.native if native else None)
    try:
        with torch.inference_mode():
            return block(x, cos, sin, cache, batch, kv_len, mask)  # [B, T, H]
    finally:
        block.native = keep


def _filled(block: Block, n: int = 6) -> tuple[KVCache, torch.Tensor]:
    """A float32 cache of 2 slots whose first n positions hold a prompt's rows (the torch path's), both slots."""
    cache = KVCache(block.attention.cfg, 32, 2, dtype=torch.float32)
    prompt = torch.randn(2, n, H, generator=torch.Generator().manual_seed(1))  # [2, n, H]
    for slot in (0, 1):
        _rows(block, cache, prompt[slot:slot + 1], [slot], [0], native=False)
    return cache, prompt


@needs_cc
def test_the_c_block_equals_the_torch_block_and_writes_the_same_kv_rows():
    block = _block()
    cache, _ = _filled(block)
    x = torch.randn(1, 1, H, generator=torch.Generator().manual_seed(2))  # [1, 1, H]: a decode row at position 6
    want = _rows(block, cache, x, [0], [6], native=False)
    k_want, v_want = cache.k[0, 0, :, 6].clone(), cache.v[0, 0, :, 6].clone()  # [KV, D]
    got = _rows(block, cache, x, [0], [6], native=True)
    assert block.native.step is not None  # the C path ran
    assert float((got - want).norm() / (want - x).norm()) < 1e-4  # the block's contribution, to float rounding
    assert torch.allclose(cache.k[0, 0, :, 6], k_want, atol=1e-4) and torch.allclose(cache.v[0, 0, :, 6], v_want,
                                                                                        atol=1e-4)
    xs = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(3))  # two slots, 3 rows each (verify-like)
    want = _rows(block, cache, xs, [0, 1], [6, 6], native=False)
    got = _rows(block, cache, xs, [0, 1], [6, 6], native=True)
    assert float((got - want).norm() / (want - xs).norm()) < 1e-4


@needs_cc
def test_a_rows_result_does_not_depend_on_the_call_or_the_body():
    """A verify pass's rows equal the one-row calls' bit for bit (1 or 2 threads, each body); the portable body
    agrees with the vector one to float rounding."""
    block = _block()
    cache, _ = _filled(block)
    step = None
    x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(4))  # [1, 5, H]

    def run(xr: torch.Tensor, start: int, threads: int, scalar: bool) -> torch.Tensor:
        t = xr.shape[1]
        batch = CacheBatch.make([0], [start], t, "cpu")
        angles = batch.positions[..., None].float() * rotary_inverse_frequencies(block.attention.cfg)
        kv = cache.layer(0)
        return step.run(xr.contiguous(), kv["k"], kv["v"], batch.positions, batch.slot_ids,
                        angles.cos().contiguous(), angles.sin().contiguous(), threads=threads, scalar=scalar)

    _rows(block, cache, x[:, :1], [0], [6], native=True)  # builds the step
    step = block.native.step
    outs = {}
    for scalar in [True] + ([False] if cpu_rt.vector() else []):
        alone = torch.cat([run(x[:, i:i + 1], 6 + i, 1, scalar) for i in range(5)], dim=1)  # [1, 5, H]
        for threads in (1, 2):
            assert torch.equal(run(x, 6, threads, scalar), alone)
        outs[scalar] = alone
    if len(outs) == 2:
        assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < 1e-5


@needs_cc
def test_it_steps_aside_where_it_does_not_apply():
    block = _block()
    cache, _ = _filled(block)
    x = torch.randn(1, 17, H)  # [1, 17, H]: more rows than a verify pass (a prompt chunk)
    batch = CacheBatch.make([0], [6], 17, "cpu")
    cos = sin = torch.ones(1, 17, 1, D // 2)
    assert block.native(x, cos, sin, cache, batch) is None
    batch = CacheBatch.make([0], [6], 1, "cpu")
    int8 = KVCache(block.attention.cfg, 32, 1, dtype=torch.float32, kv_type="int8")
    assert block.native(x[:, :1], cos[:, :1], sin[:, :1], int8, batch) is None  # a quantized cache
    normed = _block()
    normed.attention.q_norm = normed.attention.k_norm = torch.nn.Identity()  # q/k norms: torch's path
    assert normed.native(x[:, :1], cos[:, :1], sin[:, :1], cache, batch) is None and normed.native.step is None
    assert block.native(x[:, :1], cos[:, :1], sin[:, :1], cache, batch) is not None


@needs_cc
def test_a_gguf_decodes_the_same_greedy_tokens_either_way(smollm2_gguf, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny-q4_0.gguf", smollm2_gguf, T.Q4_0)
    loaded = load_model(path, cpu_int4=True, cpu_kernels="native")
    steps = [b.native for b in loaded.model.layers]
    assert all(isinstance(s, NativeBlockStep) for s in steps)

    def greedy(on: bool) -> tuple[list[int], torch.Tensor]:
        for b, s in zip(loaded.model.layers, steps):
            b.native = s if on else None
        runner = ModelRunner(loaded, 64)
        slot = runner.slot(0)
        logits = runner.forward(slot, list(range(3, 40)), num_logits=1)[-1]  # [V]: a prompt chunk (torch path)
        tokens, rows = [], []
        for _ in range(12):
            tokens.append(int(logits.argmax()))
            logits = runner.forward(slot, tokens[-1:], num_logits=1)[-1]
            rows.append(logits)
        return tokens, torch.stack(rows)  # [12, V]

    (got_tokens, got), (want_tokens, want) = greedy(True), greedy(False)
    assert all(s.step is not None for s in steps)
    assert got_tokens == want_tokens and float((got - want).abs().max()) < 1e-3 * float(want.abs().max())


@needs_cc
def test_the_heads_candidates_are_those_torch_selects():
    """cpu_rt.near_top (KQuantHead's C pass) against narrow_head.recompute_near_top's selection in torch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g) * 4  # [M, V]
    logits[1, 17] = logits[1, 4000] = 30.0  # a tie at the top
    norms = torch.rand(5000, generator=g) + 0.5  # [V]
    scale = torch.tensor([1e-3, 0.05, 4.0])  # [M]: one row with many candidates
    err = norms * scale[:, None] + 1e-5  # [M, V]
    floor = (logits - err).amax(-1, keepdim=True)  # [M, 1]
    want = [torch.nonzero(row).squeeze(1) for row in logits + err >= floor]
    got = cpu_rt.near_top(logits, norms, scale, 1e-5, cap=5000)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want)) and len(want[2]) > 20
    assert cpu_rt.near_top(logits, norms, scale, 1e-5, cap=len(want[2]) - 1) is None  # too many: the caller's torch
