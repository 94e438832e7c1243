"""quant.kernels.cuda_gemv, the CUDA C++ one-row product in the engine: which matrices take it (pure functions, on
the CPU), that it is off where it cannot run, that combining split attention partials is softmax attention (CPU),
and on a GPU: every engine variant against packed_gemv_reference (split K and not, accumulated and not, a column
tail, inside a CUDA graph), the fused inputs (norm, SwiGLU, attention splits) against their references, and a decode
step's logits with it on and off. Its compilation for sm_90 / sm_86 is tests/test_cuda_rt.py's."""
from __future__ import annotations

import pytest
import torch

from quant.kernels import cuda_gemv
from quant.kernels.cuda_gemv import DEFAULT_CONFIG, MEASURED, config_for, describe, engine_configs
from quant.kernels.packed_gemv import default_variant, one_row_path

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_measured_shapes_take_their_config_and_others_the_default():
    assert config_for("tri", 128, 6144, 4096) == (4, 1) and config_for("tri", 128, 7168, 5120) == (8, 1)
    assert config_for("bin", 128, 24576, 4096) == (8, 1) and config_for("tri", 128, 34816, 5120) == (4, 2)
    assert config_for("tri", 128, 2048, 2048) == DEFAULT_CONFIG  # a shape never measured
    assert all(c is None or len(c) == 2 for c in MEASURED.values())


def test_what_it_does_not_run():
    assert config_for("tri", 128, 5120, 17408) is None  # measured slower than Triton's kwarps kernel
    assert config_for("int4", 128, 4096, 4096) is None and config_for("tri5", 128, 4096, 4096) is None
    assert config_for("tri", 64, 4096, 4096) is None  # another group size
    assert config_for("tri", 128, 4098, 4096) is None  # columns not a multiple of 4 (16-byte loads)
    assert config_for("bin", 128, 4096, 4000) is None  # K not whole groups


def test_the_default_variant_takes_it_only_for_one_row_where_enabled():
    assert default_variant("tri", 128, 1, 4096, 6144, cuda=True) == "cuda"
    assert default_variant("tri", 128, 1, 4096, 6144, cuda=False) == "2d"  # today's Triton kernel
    assert default_variant("tri", 128, 2, 4096, 6144, cuda=True) == "2d"  # verify widths: Triton
    assert default_variant("tri", 128, 1, 17408, 5120, cuda=True) == "kwarps"  # where Triton measured faster
    assert default_variant("int4", 128, 1, 4096, 6144, cuda=True) == "2d"


def test_bench_reports_the_path_and_its_split():
    assert one_row_path("tri", 128, 6144, 4096, cuda=True) == "cuda w4 g1 split 8" == describe("tri", 128, 6144, 4096)
    assert one_row_path("tri", 128, 34816, 5120, cuda=True) == "cuda w4 g2 split 5"
    assert one_row_path("tri", 128, 6144, 4096) == "2d split 16"
    assert one_row_path("tri", 128, 5120, 17408, cuda=True).startswith("kwarps")


def test_it_is_off_on_the_cpu_under_the_interpreter_and_when_turned_off(monkeypatch):
    assert not cuda_gemv.enabled(torch.device("cpu"))
    monkeypatch.setenv("BONSAI_CUDA_GEMV", "0")
    assert not cuda_gemv.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("BONSAI_CUDA_GEMV", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not cuda_gemv.enabled(torch.device("cuda", 0))


def test_the_norm_fusion_is_off_on_the_cpu_and_for_what_it_cannot_read():
    from quant.packed_layout import random_packed
    pw = random_packed("tri", 256, 512, 128)
    x, nw = torch.randn(1, 512), torch.ones(512)
    assert not cuda_gemv.norm_input_taken(x, nw, pw)  # a CPU tensor
    assert not cuda_gemv.norm_input_taken(torch.randn(2, 512), nw, pw)  # two rows
    assert not cuda_gemv.norm_input_taken(x.double(), nw, pw)
    assert not cuda_gemv.norm_input_taken(x, nw.to(torch.int32), pw)


def test_ci_compiles_every_input_the_engine_gives():
    variants = cuda_gemv.engine_variants(90)
    assert {(v["INPUT"], v["NW_KIND"]) for v in variants} == {(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (3, 1), (3, 2)}
    assert len(variants) == len(cuda_gemv.KINDS) * 3 * 2 * 7  # kinds × configs (w4 g1, w4 g2, w8 g1) × PDL × inputs


def _splits_of(q, k, v, ns, scale):
    """Flash-decoding partials of one kv head, as the attention kernel writes them: q [G, D], k / v [T, D], the keys
    cut into ns ranges of ceil(T / ns) (the last ones may be empty). part [ns, G, D], ml [ns, G, 2] (log2 units)."""
    g, d = q.shape
    per = -(-k.shape[0] // ns)
    part, ml = torch.zeros(ns, g, d), torch.zeros(ns, g, 2)
    ml[..., 0] = float("-inf")
    for s in range(ns):
        ks, vs = k[s * per:(s + 1) * per], v[s * per:(s + 1) * per]
        if ks.shape[0] == 0:
            continue
        sc = q @ ks.T * scale * 1.4426950408889634  # [G, T_s] scores in log2 units
        m = sc.amax(dim=1)  # [G]
        p = torch.exp2(sc - m[:, None])  # [G, T_s]
        part[s], ml[s, :, 0], ml[s, :, 1] = p @ vs, m, p.sum(dim=1)
    return part, ml


@pytest.mark.parametrize("ns", [1, 3, 7, 32])
def test_combining_split_partials_is_softmax_attention(ns):
    """Pure maths, on the CPU: the splits combined (what o_proj's kernel does with INPUT 3) equal softmax
    attention over all the keys, for padded groups and splits left empty."""
    gen = torch.Generator().manual_seed(ns)
    kv, group, gp, d, t = 2, 3, 4, 128, 20
    q, k, v = (torch.randn(kv, n, d, generator=gen) for n in (group, t, t))  # [KV, G, D], [KV, T, D] x2
    parts = [_splits_of(q[h], k[h], v[h], ns, d ** -0.5) for h in range(kv)]
    part = torch.zeros(kv, ns, gp, d)
    ml = torch.zeros(kv, ns, gp, 2)
    for h, (pt, m) in enumerate(parts):
        part[h, :, :group], ml[h, :, :group] = pt, m
    ml[:, :, group:, 0] = float("nan")  # padded heads are never read
    want = torch.softmax(q @ k.transpose(1, 2) * d ** -0.5, dim=-1) @ v  # [KV, G, D]
    for dtype in (torch.float32, torch.bfloat16):
        got = cuda_gemv.combine_splits_reference(part, ml, group, dtype)  # [1, KV·G·D]
        torch.testing.assert_close(got, want.to(dtype).float().reshape(1, -1), rtol=1e-2 if dtype != torch.float32
                                   else 1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_o_proj_takes_the_splits_only_on_the_cuda_path_at_128_dims(monkeypatch):
    from quant.packed_layout import random_packed
    pw = random_packed("tri", 256, 512, 128)
    assert not cuda_gemv.splits_input_taken(torch.device("cpu"), pw, 128)  # no GPU
    monkeypatch.setattr(cuda_gemv, "enabled", lambda device: True)  # as on a GPU with NVRTC
    assert cuda_gemv.splits_input_taken(None, pw, 128)
    assert not cuda_gemv.splits_input_taken(None, pw, 64)  # a group would hold two heads
    assert not cuda_gemv.splits_input_taken(None, random_packed("int4", 256, 512, 128), 128)
    monkeypatch.setenv("BONSAI_CUDA_GEMV_INPUT", "int8")
    assert not cuda_gemv.splits_input_taken(None, pw, 128)


def test_the_fusions_setting(monkeypatch):
    monkeypatch.delenv("BONSAI_CUDA_GEMV_INPUT", raising=False)
    assert cuda_gemv.fused_inputs() == "auto"
    monkeypatch.setenv("BONSAI_CUDA_GEMV_INPUT", "norm")
    assert cuda_gemv.fused_inputs() == "norm"
    monkeypatch.setenv("BONSAI_CUDA_GEMV_INPUT", "fused")
    with pytest.raises(ValueError, match="use auto, all, norm or int8"):
        cuda_gemv.fused_inputs()


def test_auto_fuses_swiglu_only_into_the_long_down_products(monkeypatch):
    from quant.packed_layout import random_packed
    monkeypatch.setattr(cuda_gemv, "enabled", lambda device: True)  # as on a GPU with NVRTC
    short, long = random_packed("tri", 128, 12288, 128), random_packed("tri", 128, 21504, 128)
    for mode, want in (("auto", (False, True)), ("all", (True, True)), ("norm", (False, False)),
                       ("int8", (False, False))):
        monkeypatch.setenv("BONSAI_CUDA_GEMV_INPUT", mode)
        assert (cuda_gemv.swiglu_input_taken(None, short), cuda_gemv.swiglu_input_taken(None, long)) == want, mode


def test_a_cpu_step_never_fuses_swiglu():
    from engine.runtime.decode_step import Workspace
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    cfg = ModelConfig("qwen3", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=128, qk_norm=True)
    loaded = load_dummy(cfg, "tiny", weight_format=WeightFormat("tri", 128, "int4"), dtype=torch.float32)
    assert not Workspace.make(loaded.model, 1, torch.device("cpu")).swiglu_in_down


def test_without_nvrtc_the_triton_kernels_run(monkeypatch):
    from quant.kernels import cuda_rt

    def missing():
        raise cuda_rt.CudaCompileError("NVRTC (libnvrtc) was not found")
    monkeypatch.setattr(cuda_rt, "nvrtc", missing)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("BONSAI_CUDA_GEMV", raising=False)
    cuda_gemv.nvrtc_ready.cache_clear()
    try:
        assert not cuda_gemv.enabled(torch.device("cuda", 0))
    finally:
        cuda_gemv.nvrtc_ready.cache_clear()


def _gpu_cases(kind: str, gen: torch.Generator):
    """(N, K, a random packed matrix on the GPU with scales in 0.5-1.5): split K 2-8 and 1, a column tail (100)."""
    from quant.packed_layout import random_packed
    for n, k in ((640, 1024), (100, 256), (1536, 4096)):
        pw = random_packed(kind, n, k, 128, device=gen.device, generator=gen)
        pw.scales.uniform_(0.5, 1.5)
        yield n, k, pw


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kind", ["tri", "bin"])
def test_every_engine_variant_equals_the_reference(kind):
    from quant.kernels.act_quant import quantize_activations
    from quant.kernels.packed_gemv import packed_gemv_reference
    dev, configs = torch.device("cuda"), engine_configs()
    gen = torch.Generator(dev).manual_seed(0)
    for n, k, pw in _gpu_cases(kind, gen):
        xq = quantize_activations(torch.randn(1, k, device=dev, generator=gen), 128)
        want = packed_gemv_reference(*xq, pw)  # [1, N]
        tol = 1e-4 * want.abs().max().item()
        for config in configs:
            got = cuda_gemv.cuda_gemv(*xq, pw, config=config)
            assert torch.allclose(got, want, rtol=1e-5, atol=tol), (kind, n, k, config)
            out = torch.full((1, n), float("nan"), device=dev)  # poisoned: a plain product overwrites it
            cuda_gemv.cuda_gemv(*xq, pw, out=out, config=config)
            assert torch.allclose(out, want, rtol=1e-5, atol=tol), (kind, n, k, config, "overwrite")
            base = torch.randn(1, n, device=dev, generator=gen)
            out = base.clone()
            graph = torch.cuda.CUDAGraph()
            cuda_gemv.cuda_gemv(*xq, pw, out=out, accumulate=True, config=config)  # warm (loads the module)
            out.copy_(base)
            with torch.cuda.graph(graph):
                cuda_gemv.cuda_gemv(*xq, pw, out=out, accumulate=True, config=config)
            out.copy_(base)
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.allclose(out, base + 2 * want, rtol=1e-5, atol=2 * tol), (kind, n, k, config, "graph")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kind", ["tri", "bin"])
def test_the_fused_input_products_equal_quantize_then_product(kind):
    from quant.kernels.act_quant import quantize_activations_reference
    from quant.kernels.packed_gemv import packed_gemv_reference
    dev, configs = torch.device("cuda"), engine_configs()
    gen = torch.Generator(dev).manual_seed(1)
    for n, k, pw in _gpu_cases(kind, gen):
        x = torch.randn(1, k, device=dev, generator=gen) * 3  # [1, K] a residual row
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            nw = (torch.rand(k, device=dev, generator=gen) + 0.5).to(dtype)  # [K]
            want = packed_gemv_reference(*quantize_activations_reference(x, 128, nw, 1e-6), pw)  # [1, N]
            tol = 3e-3 * want.abs().max().item()  # a code one int8 step off where the sum of squares rounds apart
            for config in configs:
                got = cuda_gemv.cuda_norm_gemv(x, nw, 1e-6, pw, config=config)
                assert torch.allclose(got, want, rtol=1e-3, atol=tol), (kind, n, k, dtype, config)
                out, zero = torch.ones(1, n, device=dev), torch.ones(3, 1000, device=dev)
                cuda_gemv.cuda_norm_gemv(x, nw, 1e-6, pw, out=out, accumulate=True, config=config, zero=zero)
                assert torch.allclose(out, want + 1, rtol=1e-3, atol=tol), (kind, n, k, dtype, config, "accumulate")
                assert not zero.any(), "the buffer to zero"
        gu = torch.randn(1, 2 * k, device=dev, generator=gen) * 2  # [1, 2K] gate | up
        want = packed_gemv_reference(*quantize_activations_reference(gu, 128, gated=True), pw)  # [1, N]
        before = gu.clone()
        for config in configs:
            got = cuda_gemv.cuda_swiglu_gemv(gu, pw, config=config)
            assert torch.allclose(got, want, rtol=1e-3, atol=3e-3 * want.abs().max().item()), (kind, n, k, config)
        assert torch.equal(gu, before)  # left as it is: the decode step's q/k/v product zeroes it


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("kind", ["tri", "bin"])
def test_the_splits_input_product_equals_combine_then_product(kind):
    """cuda_splits_gemv (o_proj combining its attention's splits) against splits_gemv_reference: random partials
    with empty splits, 1-32 splits, a padded group, both rounding dtypes, every config, the buffer to zero."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(3)
    from quant.packed_layout import random_packed
    for kv, group, gp, n in ((2, 4, 4, 640), (4, 5, 8, 256), (1, 1, 1, 100)):
        pw = random_packed(kind, n, kv * group * 128, 128, device=dev, generator=gen)
        pw.scales.uniform_(0.5, 1.5)
        for ns in (1, 3, 16, 17, 32):
            part = torch.randn(kv, ns, gp, 128, device=dev, generator=gen) * 3  # [KV, S, GP, D]
            ml = torch.stack([torch.randn(kv, ns, gp, device=dev, generator=gen) * 4,
                              torch.rand(kv, ns, gp, device=dev, generator=gen) * 5 + 0.5], dim=-1)  # [KV, S, GP, 2]
            if ns > 2:  # the last split empty (no keys)
                ml[:, -1, :, 0], ml[:, -1, :, 1], part[:, -1] = float("-inf"), 0.0, 0.0
            for dtype in (torch.bfloat16, torch.float16):
                want = cuda_gemv.splits_gemv_reference(part, ml, group, dtype, pw)  # [1, N]
                tol = 3e-3 * want.abs().max().item()
                for config in engine_configs():
                    out, zero = torch.ones(1, n, device=dev), torch.ones(5, 77, device=dev)
                    cuda_gemv.cuda_splits_gemv(part, ml, group, dtype, pw, out=out, accumulate=True, config=config,
                                               zero=zero)
                    assert torch.allclose(out, want + 1, rtol=1e-3, atol=tol), (kind, kv, group, ns, dtype, config)
                    assert not zero.any(), "the buffer to zero"


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("weights", ["tri", "bin"])
@pytest.mark.parametrize("inputs", ["all", "norm"])
def test_a_graphed_decode_step_on_it_matches_the_model(monkeypatch, weights, inputs):
    from engine.runtime.cuda_graphs import DecodeStepRunner
    from engine.runtime.runner import ModelRunner
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    from engine.weights.packed_linear import decode_paths
    monkeypatch.setenv("BONSAI_CUDA_GEMV", "1")
    monkeypatch.setenv("BONSAI_CUDA_GEMV_INPUT", inputs)
    cfg = ModelConfig("qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=128, qk_norm=True)
    loaded = load_dummy(cfg, "tiny", device="cuda", weight_format=WeightFormat(weights, 128, "int4"),
                        dtype=torch.float32)
    assert all(p.startswith("cuda") for k, p in decode_paths(loaded.model).items() if k.startswith(weights)), \
        decode_paths(loaded.model)
    tokens = list(range(3, 19))
    plain = ModelRunner(loaded, max_seq_len=64, fast_decode=False)  # the per-op path (Triton, no graph)
    slot = plain.slot(0)
    plain.prefill(slot, tokens[:10])
    monkeypatch.setenv("BONSAI_CUDA_GEMV", "0")
    want = [plain.forward(slot, [t])[0] for t in tokens[10:]]
    monkeypatch.setenv("BONSAI_CUDA_GEMV", "1")
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    slot = runner.slot(0)
    runner.prefill(slot, tokens[:10])
    step = DecodeStepRunner(loaded.model, runner.cache, rows=1, num_splits=2, kernels=True)
    assert step.graph is not None  # all: norm and SwiGLU fused, the gate/up buffer zeroed by q/k/v
    assert step.workspace.swiglu_in_down == (inputs == "all")
    for i, (token, ref) in enumerate(zip(tokens[10:], want)):
        got = step.run([token], [10 + i], [0])[0]
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
        assert got.argmax() == ref.argmax()
