"""engine.kernels.cuda_attention, one decode row's attention block in one CUDA C++ launch: which models and caches
take it and that it is off where it cannot run (on the CPU), that NVRTC compiles every variant the engine launches
for sm_90 and sm_86 (CI, no GPU), and on a GPU: the kernel against the reference (the rope / KV-write reference,
then attention quantized per head) over shapes, positions, splits and cache dtypes — also the partials-only kernel
whose splits o_proj combines —, inside a CUDA graph, and a graphed decode step with it (either combine) against the
per-op path."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import cuda_attention as ca
from tests.test_cuda_rt import nvrtc_lib  # noqa: F401  (the fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("heads, kv, d, ok", [
    (32, 8, 128, True),    # Qwen3-8B (4 a kv head)
    (40, 8, 128, True),    # the dense 27B-class (5, padded to 8)
    (16, 8, 128, True),    # Qwen3-1.7B
    (12, 2, 128, True),    # Qwen2.5-Coder-1.5B (6)
    (14, 2, 64, True),     # Qwen2.5-Coder-0.5B (7)
    (9, 9, 64, True),      # one query head a kv head
    (24, 4, 256, False),   # 6 a kv head at head_dim 256: 8 x 256 partial rows do not fit
    (16, 4, 256, True),
    (36, 4, 128, False),   # 9 a kv head
    (32, 8, 96, False),    # head_dim 96
    (30, 8, 128, False),   # not a multiple
])
def test_the_shapes_it_takes(heads, kv, d, ok):
    assert ca.shape_supported(heads, kv, d) == ok


def test_splits_cover_the_sms_and_stop_at_the_combines_limit(monkeypatch):
    monkeypatch.delenv("BONSAI_CUDA_ATTN_SPLITS", raising=False)
    assert ca.num_splits(640, 8, 132) == 20          # 20 of 32 keys
    assert ca.num_splits(64, 8, 132) == 4            # 2 of 32 would leave SMs idle; no split under 16 keys
    assert ca.num_splits(4096, 8, 132) == ca.MAX_SPLITS
    assert ca.num_splits(40960, 2, 132) == ca.MAX_SPLITS
    assert ca.num_splits(16, 8, 132) == 1
    monkeypatch.setenv("BONSAI_CUDA_ATTN_SPLITS", "3")
    assert ca.num_splits(4096, 8, 132) == 3
    monkeypatch.setenv("BONSAI_CUDA_ATTN_SPLITS", "999")
    assert ca.num_splits(4096, 8, 132) == ca.MAX_SPLITS


def test_a_cluster_size_other_than_8_or_16_is_refused(monkeypatch):
    monkeypatch.setenv("BONSAI_CUDA_ATTN_CLUSTER", "4")
    with pytest.raises(ValueError, match="use 0, 8 or 16"):
        ca.AttentionBuffers.make(32, 8, 128, 640, torch.device("cpu"))
    monkeypatch.setenv("BONSAI_CUDA_ATTN_CLUSTER", "16")  # no cluster off sm_90: the counter's splits
    assert not ca.AttentionBuffers.make(32, 8, 128, 640, torch.device("cpu")).cluster


def test_it_is_off_on_the_cpu_under_the_interpreter_and_when_turned_off(monkeypatch):
    assert not ca.enabled(torch.device("cpu"))
    monkeypatch.setenv("BONSAI_CUDA_ATTN", "0")
    assert not ca.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("BONSAI_CUDA_ATTN", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not ca.enabled(torch.device("cuda", 0))


def test_ci_compiles_every_variant_the_engine_launches():
    variants = ca.engine_variants(90)
    assert {v["D"] for v in variants} == set(ca.HEAD_DIMS) and {v["USE_PDL"] for v in variants} == {0, 1}
    assert {v["GP"] for v in variants} == {1, 2, 4, 8} and {v["CACHE_KIND"] for v in variants} == {1, 2}
    assert not any(v["GP"] * v["D"] > 1024 for v in variants)
    assert {v["CLUSTER"] for v in variants} == {0, 1}
    assert {(v["USE_PDL"], v["CLUSTER"]) for v in ca.engine_variants(86)} == {(0, 0)}  # both are sm_90's
    assert {(v["D"], v["CLUSTER"]) for v in variants if not v["COMBINE"]} == {(128, 0)}  # o_proj combines: 128 dims
    # what decode_step passes: the padded group of every shape it takes, the norm in the cache's dtype or none
    for heads, kv, d in ((32, 8, 128), (40, 8, 128), (12, 2, 128), (14, 2, 64), (9, 9, 64)):
        for cache_kind in ca.CACHE_KINDS.values():
            for norm in (None, cache_kind):
                for cluster in (False, True):
                    assert ca.defines(d, heads // kv, norm, cache_kind, True, cluster=cluster) in variants
                if d == 128:
                    for arch in (90, 86):
                        assert ca.defines(d, heads // kv, norm, cache_kind, arch >= 90, combine=False) \
                            in ca.engine_variants(arch)


@pytest.mark.parametrize("arch", [90, 86])
def test_every_variant_compiles(nvrtc_lib, arch):  # noqa: F811
    from quant.kernels import cuda_rt
    for flags in ca.engine_variants(arch):
        assert cuda_rt.compile_cubin(ca.SOURCE, arch, flags)[:4] == b"\x7fELF", flags


def _tiny(dtype=torch.bfloat16, device="cpu", layers=2, **kw):
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True) | kw
    cfg = ModelConfig("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=layers, **shape)
    return load_dummy(cfg, "tiny", device=device, weight_format=WeightFormat("tri", 128, "int4"), dtype=dtype)


def test_which_steps_take_it(monkeypatch):
    """The model / cache rules, on the CPU with the switch forced on: a float 16-bit cache, a packed o_proj at
    group = head_dim, q/k norms in the cache's dtype; never a quantized or 32-bit cache, nor a CPU workspace."""
    from engine.runtime import decode_step
    from engine.runtime.kv_cache import KVCache
    loaded = _tiny()
    model = loaded.model
    cache = KVCache(model.config, 64, 1, dtype=torch.bfloat16)
    assert not decode_step.fused_attention_taken(model, cache)  # the CPU: off
    monkeypatch.setattr(ca, "enabled", lambda device: True)
    assert decode_step.fused_attention_taken(model, cache)
    assert not decode_step.fused_attention_taken(model, KVCache(model.config, 64, 1, dtype=torch.bfloat16,
                                                                kv_type="int8"))
    assert not decode_step.fused_attention_taken(model, KVCache(model.config, 64, 1, dtype=torch.float32))
    ws = decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache)
    assert ws.attention is not None and ws.attention.splits == ca.num_splits(64, 2)
    assert ws.attention.combine  # o_proj cannot combine on the CPU: the attention kernel's last block does
    from quant.kernels import cuda_gemv
    monkeypatch.setattr(cuda_gemv, "enabled", lambda device: True)  # o_proj on the CUDA C++ product
    assert decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache).attention.combine  # auto: 4 heads
    monkeypatch.setattr(ca, "PRODUCT_FROM_HEADS", 4)
    assert not decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache).attention.combine
    monkeypatch.setattr(ca, "PRODUCT_FROM_HEADS", 5)
    assert decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache).attention.combine
    monkeypatch.setenv("BONSAI_CUDA_ATTN_COMBINE", "product")
    assert not decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache).attention.combine
    monkeypatch.setenv("BONSAI_CUDA_ATTN_COMBINE", "attention")
    assert decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache).attention.combine
    monkeypatch.setenv("BONSAI_CUDA_ATTN_COMBINE", "o_proj")
    with pytest.raises(ValueError, match="use auto, product or attention"):
        decode_step.Workspace.make(model, 1, torch.device("cpu"), cache=cache)
    monkeypatch.delenv("BONSAI_CUDA_ATTN_COMBINE")
    assert decode_step.Workspace.make(model, 2, torch.device("cpu"), cache=cache).attention is None  # one row only
    model.layers[1].attention.q_norm.weight.data = model.layers[1].attention.q_norm.weight.data.float()
    assert not decode_step.fused_attention_taken(model, cache)  # a norm weight in another dtype
    unpacked = _tiny(num_heads=36, num_kv_heads=4)  # 9 query heads a kv head
    assert not decode_step.fused_attention_taken(unpacked.model, KVCache(unpacked.model.config, 64, 1,
                                                                         dtype=torch.bfloat16))


# ---------------------------------------------------------------- GPU


def _case(heads, kv, d, dtype, norm, seq, gen, slots=2):
    qkv = torch.randn(1, (heads + 2 * kv) * d, device="cuda", generator=gen) * 2  # [1, (H + 2KV) D]
    k_cache = (torch.randn(slots, kv, seq, d, device="cuda", generator=gen)).to(dtype)  # [slots, KV, S, D]
    v_cache = (torch.randn(slots, kv, seq, d, device="cuda", generator=gen)).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))  # [D/2]
    weights = [(1 + 0.3 * torch.randn(d, device="cuda", generator=gen)).to(dtype) for _ in range(2)] if norm \
        else [None, None]
    return qkv, k_cache, v_cache, inv_freq, weights


def _check(got, want, where):
    deq = [x.float().view(-1, s.shape[-1], x.shape[-1] // s.shape[-1]) * s.float().view(-1, s.shape[-1], 1)
           for x, s in ((got[0], got[1]), (want[0], want[1]))]  # [1, H, D] each
    scale = want[1].abs().max().item() * 127
    torch.testing.assert_close(deq[0], deq[1], rtol=0.02, atol=0.02 * scale, msg=lambda m: f"{where}: {m}")
    codes = got[0].float().view(-1, got[1].shape[-1], got[0].shape[-1] // got[1].shape[-1])
    assert torch.equal(got[2], codes.sum(-1).int()), where  # the sums are of the codes written


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("heads, kv, d, norm", [(32, 8, 128, True), (40, 8, 128, True), (12, 2, 128, False),
                                                (14, 2, 64, False), (8, 8, 64, True), (16, 4, 256, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_equals_the_reference(heads, kv, d, norm, dtype):
    gen = torch.Generator(device="cuda").manual_seed(heads * d)
    seq = 300
    clusters = torch.cuda.get_device_capability()[0] >= 9  # the cluster combine: sm_90
    for splits, cluster in ((1, False), (3, False), (ca.num_splits(seq, kv), False), (ca.MAX_SPLITS, False),
                            (8, clusters), (16, clusters)):
        for pos, slot in ((0, 0), (1, 1), (7, 0), (63, 1), (64, 0), (257, 1), (seq - 1, 0), (seq + 5, 1)):
            qkv, k_cache, v_cache, inv_freq, (qn, kn) = _case(heads, kv, d, dtype, norm, seq, gen)
            positions = torch.tensor([pos], dtype=torch.int32, device="cuda")
            slots = torch.tensor([slot], dtype=torch.int32, device="cuda")
            buffers = ca.AttentionBuffers.make(heads, kv, d, seq, torch.device("cuda"))
            buffers = ca.AttentionBuffers(buffers.part.new_zeros(kv, splits, *buffers.part.shape[2:]),
                                          buffers.ml.new_zeros(kv, splits, *buffers.ml.shape[2:]), buffers.counter,
                                          cluster=cluster)
            caches = (k_cache.clone(), v_cache.clone())
            args = (positions, slots, inv_freq)
            want = ca.rope_attention_reference(qkv.clone(), *args, *caches, heads, kv, d, qn, kn, 1e-6, d ** -0.5)
            mine = qkv.clone()
            got = ca.rope_attention(mine, *args, k_cache, v_cache, heads, kv, d, qn, kn, 1e-6, d ** -0.5, buffers,
                                    zero_input=True)
            where = f"H{heads} KV{kv} D{d} {dtype} splits {splits} cluster {cluster} pos {pos} slot {slot}"
            torch.cuda.synchronize()
            assert not mine.any() and not buffers.counter.any(), where  # input zeroed, counters reset
            _check(got, want, where)
            got = ca.rope_attention(qkv.clone(), *args, k_cache, v_cache, heads, kv, d, qn, kn, 1e-6, d ** -0.5,
                                    buffers)  # again on the reset counters (the same row written again)
            _check(got, want, where)
            if d == 128 and not cluster:  # the partials-only kernel, combined as o_proj's product does
                _check_partials(qkv, args, (k_cache, v_cache), heads, kv, d, qn, kn, dtype, buffers, want, where)
            for mine_c, ref_c in zip((k_cache, v_cache), caches):  # the row written, nothing else touched
                torch.testing.assert_close(mine_c.float(), ref_c.float(), rtol=0.01, atol=0.02, msg=where)
                if pos < seq:
                    mask = torch.ones_like(mine_c, dtype=torch.bool)
                    mask[slot, :, pos] = False
                    assert torch.equal(mine_c[mask], ref_c[mask]), where


def _check_partials(qkv, args, caches, heads, kv, d, qn, kn, dtype, buffers, want, where):
    from quant.kernels.act_quant import quantize_activations_reference
    from quant.kernels.cuda_gemv import combine_splits_reference
    mine = qkv.clone()
    split_buffers = ca.AttentionBuffers(torch.full_like(buffers.part, float("nan")),
                                        torch.full_like(buffers.ml, float("nan")), buffers.counter, combine=False)
    part, ml = ca.rope_attention_partials(mine, *args, *caches, heads, kv, d, qn, kn, 1e-6, d ** -0.5, split_buffers)
    heads_out = combine_splits_reference(part, ml, heads // kv, dtype)  # [1, H·D]
    _check(quantize_activations_reference(heads_out, d), want, where + " (partials)")
    torch.cuda.synchronize()
    assert torch.equal(mine, qkv) and not buffers.counter.any(), where  # input left for o_proj to zero


@pytest.mark.gpu
@CUDA
def test_inside_a_graph_at_any_position():
    gen = torch.Generator(device="cuda").manual_seed(5)
    heads, kv, d, seq = 32, 8, 128, 1024
    qkv, k_cache, v_cache, inv_freq, (qn, kn) = _case(heads, kv, d, torch.bfloat16, True, seq, gen, slots=1)
    positions = torch.zeros(1, dtype=torch.int32, device="cuda")
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    buffers = ca.AttentionBuffers.make(heads, kv, d, seq, torch.device("cuda"))
    static = qkv.clone()
    ca.rope_attention(static.clone(), positions, slots, inv_freq, k_cache.clone(), v_cache.clone(), heads, kv, d,
                      qn, kn, 1e-6, d ** -0.5, buffers)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ca.rope_attention(static, positions, slots, inv_freq, k_cache, v_cache, heads, kv, d, qn, kn, 1e-6,
                                d ** -0.5, buffers)
    for pos in (3, 500, 130, seq - 1):
        ref_caches = (k_cache.clone(), v_cache.clone())
        want = ca.rope_attention_reference(qkv.clone(), positions.fill_(pos), slots, inv_freq, *ref_caches, heads,
                                           kv, d, qn, kn, 1e-6, d ** -0.5)
        static.copy_(qkv)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, want, f"replay at {pos}")
        torch.testing.assert_close(k_cache[0, :, pos].float(), ref_caches[0][0, :, pos].float(), rtol=0.01,
                                   atol=0.02)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("shape", [dict(num_heads=4, num_kv_heads=2), dict(num_heads=6, num_kv_heads=2)])
@pytest.mark.parametrize("combine", ["product", "attention", "auto"])
def test_a_graphed_decode_step_with_it_matches_the_per_op_path(monkeypatch, shape, combine):
    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.runner import ModelRunner
    loaded = _tiny(device="cuda", **shape)
    tokens = list(range(3, 40))
    plain = ModelRunner(loaded, max_seq_len=128, fast_decode=False)  # the per-op path (Triton, no graph)
    slot = plain.slot(0)
    plain.prefill(slot, tokens[:10])
    want = [plain.forward(slot, [t])[0] for t in tokens[10:]]
    runner = ModelRunner(loaded, max_seq_len=128, fast_decode=False)
    slot = runner.slot(0)
    runner.prefill(slot, tokens[:10])
    monkeypatch.setenv("BONSAI_CUDA_ATTN", "1")
    monkeypatch.setenv("BONSAI_CUDA_ATTN_COMBINE", combine)
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=True)
    assert step.graph is not None and step.workspace.attention is not None
    assert step.workspace.attention.combine == (combine != "product")  # auto: 4-6 heads, the last block
    for i, (token, ref) in enumerate(zip(tokens[10:], want)):
        got = step.run([token], [10 + i], [0])[0]
        torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
        assert got.argmax() == ref.argmax(), i
