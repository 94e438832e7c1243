"""The native CPU kernels (quant/kernels/cpu_kquant.c, engine.runtime.cpu_kquant): the repacking of every GGUF
block type against gguf's own dequantizer (no model), the compiled kernels — vector and portable bodies — against
float products of the same weights, row independence (a verify pass = the decode step's rows, bit for bit) at
several thread counts, the layer with mixed parts and its prompt-chunk path, the loader and the settings, and a
compile of each variant CI can build whatever its CPU."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine.errors import BonsaiError
from engine.run.config import RunConfig
from engine.runtime import cpu_kquant
from engine.runtime.cpu_kquant import KQuantCpuLinear, KQuantHead
from engine.runtime.runner import ModelRunner
from engine.weights.cpu_int4_load import resolve_cpu_kernels
from engine.weights.loader import load_model
from quant import gguf_types, kquant_pack
from quant.kernels import cpu_rt
from tests.gguf_tiny import random_k_quant_bytes, write_tiny_gguf

needs_cc = pytest.mark.skipif(cpu_rt.compiler() is None, reason="no C compiler on this machine")
TYPES = [T.Q4_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def _raw(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of `qtype`: K-quants from random bytes (every code, scale and min pattern) with varied d,
    the others quantized from random weights by gguf's own quantizer."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_K, T.Q6_K):
        raw = random_k_quant_bytes(rng, qtype, rows, cols)
        size = 144 if qtype == T.Q4_K else 210
        blocks = raw.reshape(rows, cols // 256, size)
        d = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 2)).astype(np.float16).view(np.uint8)  # [.., 4]
        if qtype == T.Q4_K:
            blocks[..., 0:4] = d.reshape(rows, cols // 256, 4)
        else:
            blocks[..., 208:210] = d.reshape(rows, cols // 256, 4)[..., :2]
        return blocks.reshape(rows, -1)
    w = (rng.standard_normal((rows, cols)) * 0.05 + (0.02 if qtype in (T.Q4_1, T.Q5_1) else 0.0)).astype(np.float32)
    return gguf_quants.quantize(w, qtype)


def _tensors(p: kquant_pack.Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (p.qs, p.qh, p.meta))


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_blocks_hold_the_stored_values_exactly(qtype):
    cols = 512 if qtype in (T.Q4_K, T.Q6_K) else 160  # 160: a width the a4 / a8 layouts pad to 256
    raw = _raw(qtype, 24, cols)
    packed = kquant_pack.pack(raw, int(qtype), cols)
    assert packed.fmt == kquant_pack.PACKABLE[int(qtype)][0] and packed.kp % 128 == 0 and packed.kp >= cols
    if packed.fmt == "a5":  # Q5_0 / Q5_1 at 6 bits a weight (4-bit codes, a plane of bit 4, fp16 d and m per 32)
        assert packed.nbytes * 8 == 6 * 24 * packed.kp
    ref = gguf_types.dequantize(raw, int(qtype), (24, cols)).numpy()
    np.testing.assert_array_equal(kquant_pack.dequantize(packed), ref)


def test_affine_codes_repack_into_the_4_bit_layout():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (8, 96)).astype(np.uint8)
    s, z = rng.uniform(0.01, 0.02, (8, 3)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32) * 0.1
    want = (codes.reshape(8, 3, 32) - 8.0) * s[..., None] + z[..., None]  # [N, K/32, 32]
    got = kquant_pack.dequantize(kquant_pack.from_affine(codes, s, z)).reshape(8, 3, 32)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)  # d and m rounded to fp16


def test_a_type_the_kernels_do_not_take_is_not_packed():
    assert kquant_pack.pack(np.zeros((2, 4 * 256 // 256 * 84), np.uint8), int(T.Q2_K), 256) is None


@needs_cc
@pytest.mark.parametrize("order", [0, 1, 2])
def test_activations_are_rounded_per_32_in_two_passes_and_ordered_as_the_format_reads_them(order):
    gen = torch.Generator().manual_seed(order)
    x = torch.randn(3, 200, generator=gen) * torch.tensor([[1.0], [0.01], [100.0]])  # [M, K]
    x[1, :32] = 0.0  # an all-zero block: unit 0, codes 0
    x[2, 40] = 5e4  # an outlier: its own 32 values get a coarse unit, no others
    xq, xd, xs = cpu_rt.quantize_rows(x, 256, order)
    per = 16 if order == 2 else 32
    assert xq.shape == (3, 512) and xd.shape == (3, 8) and xs.shape == (3, 256 // per)
    blocks = torch.nn.functional.pad(x, (0, 56)).view(3, 8, 32)  # [M, Kp/32, 32]
    assert torch.allclose(xd, blocks.abs().amax(-1) / 127 / 254)
    q1, q2 = xq[:, :256], xq[:, 256:]  # [M, Kp] each, in kernel positions
    if order:  # kernel positions → natural order
        natural = torch.from_numpy(kquant_pack.NATURAL["q4k" if order == 1 else "q6k"])
        assert sorted(natural.tolist()) == list(range(256))
        assert [cpu_rt.library().kq_natural(order, p) for p in (0, 5, 77, 255)] == [int(natural[p]) for p in (0, 5, 77, 255)]
        q1, q2 = (torch.empty_like(q).index_copy_(1, natural, q) for q in (q1, q2))
    assert int(q2.abs().max()) <= 127
    codes = 254 * q1.int() + q2.int()  # [M, Kp]
    back = codes.view(3, 8, 32).double() * xd.double()[..., None]
    # within half a unit, plus float32's rounding of x − q1·d (|x| ≤ 127·254 units: ~0.002 of one)
    assert bool(((back - blocks.double()).abs() <= xd.double()[..., None] * (0.5 + 1e-2) + 1e-30).all())
    sums = codes.view(3, 256 // per, per).sum(-1).float() * xd.repeat_interleave(32 // per, dim=1)
    assert torch.allclose(xs, sums, rtol=1e-6) and not bool(codes[:, 200:].any())


def _run(packed, x: torch.Tensor, scalar: bool, threads: int = 2, lib=None) -> torch.Tensor:
    acts = cpu_rt.quantize_rows(x, packed.kp, kquant_pack.ACT_ORDER[packed.fmt], lib=lib)
    y = torch.full((x.shape[0], packed.n + 5), float("nan"))  # a wider output: the part writes its columns only
    cpu_rt.matmul(packed.fmt, *_tensors(packed), packed.n, packed.kp, acts, y, 3, threads=threads, scalar=scalar,
                  lib=lib)
    assert bool(y[:, :3].isnan().all()) and bool(y[:, 3 + packed.n:].isnan().all())
    return y[:, 3:3 + packed.n]


@needs_cc
@pytest.mark.parametrize("qtype", TYPES)
def test_the_kernels_multiply_by_the_stored_weights(qtype):
    cols = 512 if qtype in (T.Q4_K, T.Q6_K) else 160
    packed = kquant_pack.pack(_raw(qtype, 40, cols, seed=1), int(qtype), cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))  # [M, K]
    want = x.double() @ torch.from_numpy(kquant_pack.dequantize(packed)).double().t()  # [M, N]
    bodies = [True] + ([False] if cpu_rt.vector() else [])
    outs = [_run(packed, x, scalar) for scalar in bodies]
    for y in outs:  # activations to ~16 bits of their block's largest: float32's own rounding order
        assert float((y.double() - want).norm() / want.norm()) < 2e-4
    if len(outs) == 2:  # the vector body sums the same integers in another order: float rounding only
        assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_cc
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_1, T.Q5_0, T.Q8_0])
def test_a_rows_result_does_not_depend_on_the_call(qtype):
    """A verify pass of up to 20 rows (more than the kernel's 16-row tile) at 1 or 2 threads: each row equals
    the one-row call's bit for bit."""
    cols = 512 if qtype in (T.Q4_K, T.Q6_K) else 256
    packed = kquant_pack.pack(_raw(qtype, 48, cols, seed=2), int(qtype), cols)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(1))
    for scalar in [True] + ([False] if cpu_rt.vector() else []):
        alone = torch.cat([_run(packed, x[i:i + 1], scalar, threads=1) for i in range(20)])
        for threads in (1, 2):
            assert torch.equal(_run(packed, x, scalar, threads), alone)


def _layer(bias: bool = False) -> tuple[KQuantCpuLinear, torch.Tensor]:
    """q/k/v-like: a Q4_K part and a Q6_K part of one width, stacked."""
    parts = [kquant_pack.pack(_raw(T.Q4_K, 64, 512, 3), int(T.Q4_K), 512),
             kquant_pack.pack(_raw(T.Q6_K, 32, 512, 4), int(T.Q6_K), 512)]
    b = torch.randn(96, generator=torch.Generator().manual_seed(5)) if bias else None
    weight = torch.from_numpy(np.concatenate([kquant_pack.dequantize(p) for p in parts]))  # [96, 512]
    return KQuantCpuLinear(parts, b), weight


@needs_cc
def test_a_layer_of_mixed_parts_multiplies_by_its_stacked_weights():
    layer, weight = _layer(bias=True)
    assert layer.out_features == 96 and layer.kinds == ["q4k", "q6k"] and torch.equal(layer.dequantized(), weight)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(0))  # [B, T, K]
    want = x @ weight.t() + layer.bias
    y = layer(x)
    assert y.shape == (2, 3, 96) and float((y - want).norm() / want.norm()) < 0.02


@needs_cc
def test_a_prompt_chunk_takes_the_bfloat16_path_and_agrees(monkeypatch):
    layer, weight = _layer()
    x = torch.randn(cpu_kquant.PREFILL_ROWS, 512, generator=torch.Generator().manual_seed(0))  # [M, K]
    want = x @ weight.t()
    monkeypatch.setattr(cpu_kquant, "CHUNK", 512 * 40)  # several chunks a part
    calls = []
    real = cpu_rt.dequant_bf16
    monkeypatch.setattr(cpu_rt, "dequant_bf16", lambda *a, **k: calls.append(a[4:6]) or real(*a, **k))
    y = layer(x)
    if cpu_kquant.cpu_bf16_gemm():
        assert calls == [(0, 40), (40, 64), (0, 32)]
        assert float((y - want).norm() / want.norm()) < 0.01  # bfloat16 weights and activations
    else:
        assert calls == []  # no native bfloat16 GEMM: the kernel's rows
    assert float((y - want).norm() / want.norm()) < 0.02


def _cpu_flags() -> set[str]:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory):
    """The kernels built for AVX2 + FMA + F16C only (what `-march=native` gives a CPU without AVX512-VNNI), loaded
    wherever the CPU runs them — also on a CPU whose own build takes the AVX512 body."""
    if cpu_rt.compiler() is None or not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("no C compiler, or a CPU without AVX2 + FMA + F16C")
    lib = cpu_rt.load(cpu_rt.build(BASE_FLAGS + AVX2_FLAGS, out=tmp_path_factory.mktemp("avx2") / "k.so"))
    assert cpu_rt.body(lib) == "avx2"
    return lib


@pytest.mark.parametrize("qtype", TYPES)
def test_the_avx2_body_agrees_with_the_portable_one_row_by_row(qtype, avx2_lib):
    """Every format through the AVX2 body against the portable loops, with rows that drive its int16 pair sums to
    their bounds (every activation at ±127 codes, signs matched to the codes' order or not); 20 rows (more than a
    16-row tile) equal the one-row calls bit for bit at 1 and 2 threads."""
    cols = 512 if qtype in (T.Q4_K, T.Q6_K) else 256
    packed = kquant_pack.pack(_raw(qtype, 40, cols, seed=3), int(qtype), cols)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(2))  # [M, K]
    x[0], x[1] = 1.0, -1.0  # q1 = ±127 everywhere, q2 = 0: the largest same-signed pair sums
    x[2] = torch.where(torch.arange(cols) % 3 == 0, -1.0, 1.0)
    want = x.double() @ torch.from_numpy(kquant_pack.dequantize(packed)).double().t()  # [M, N]
    portable = _run(packed, x, True)
    got = _run(packed, x, False, lib=avx2_lib)
    scale = float(want.abs().max())
    assert float((got.double() - want).abs().max()) < 2e-4 * scale
    assert torch.allclose(got, portable, rtol=1e-4, atol=1e-5 * scale)
    alone = torch.cat([_run(packed, x[i:i + 1], False, threads=1, lib=avx2_lib) for i in range(20)])
    for threads in (1, 2):
        assert torch.equal(_run(packed, x, False, threads, lib=avx2_lib), alone)


@needs_cc
@pytest.mark.parametrize("flags", [("-DKQ_SCALAR",), ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                                                      "-mf16c", "-mfma"), AVX2_FLAGS])
def test_each_variant_compiles_on_any_build_machine(flags, tmp_path):
    """The portable body, the AVX512-VNNI body and the AVX2 one (what `-march=native` picks on such CPUs) all
    compile here, whatever this machine's CPU; a vector one is only loaded where the CPU runs it."""
    out = cpu_rt.build((*BASE_FLAGS, *flags), out=tmp_path / "k.so")
    assert out.stat().st_size > 0
    symbols = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout
    assert all(name in symbols for name in ("kq_matmul", "kq_quantize", "kq_dequant_bf16", "kq_vector", "kq_block"))


def test_no_compiler_leaves_torch_or_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setenv("BONSAI_CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BONSAI_KERNEL_CACHE", str(tmp_path / "cache"))
    for fn in (cpu_rt.library, cpu_rt.build_error):
        fn.cache_clear()
    try:
        assert cpu_rt.library() is None and "no C compiler" in cpu_rt.build_error()
        assert resolve_cpu_kernels("auto") == "torch" and resolve_cpu_kernels("torch") == "torch"
        with pytest.raises(BonsaiError, match="runtime.cpu_kernels: native needs a C compiler.*use cpu_kernels: torch"):
            resolve_cpu_kernels("native")
    finally:
        for fn in (cpu_rt.library, cpu_rt.build_error):
            fn.cache_clear()


def test_the_setting_is_checked():
    assert RunConfig.from_dict({"model": {"path": "x.gguf"}}).runtime.cpu_kernels == "auto"
    with pytest.raises(BonsaiError, match="runtime.cpu_kernels: 'fast' is not one of auto, native, torch"):
        RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"cpu_kernels": "fast"}})


@pytest.fixture(scope="module")
def tiny_q4(smollm2_gguf, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("kq") / "tiny-q4_1.gguf", smollm2_gguf, T.Q4_1)


@needs_cc
def test_a_gguf_loads_its_block_matrices_into_the_native_kernels(tiny_q4):
    native = load_model(tiny_q4, cpu_int4=True, cpu_kernels="native")
    exact = load_model(tiny_q4, weight_dtype=torch.float32)
    assert native.cpu_kernels == "native" and native.int4_layers == 2 * 4
    block, ref = native.model.layers[0], exact.model.layers[0]
    assert isinstance(block.attention.wqkv, KQuantCpuLinear) and isinstance(block.feed_forward.w2, KQuantCpuLinear)
    for mine, theirs in ((block.attention.wqkv, ref.attention.wqkv), (block.feed_forward.w13, ref.feed_forward.w13)):
        assert torch.equal(mine.dequantized(), theirs.weight)  # the stored values, llama q/k rows un-permuted
    ids = [1, 5, 9, 14, 3]
    def logits(loaded) -> torch.Tensor:
        runner = ModelRunner(loaded, 16)
        return runner.forward(runner.slot(0), ids, num_logits=len(ids))  # [T, V]
    got, want = logits(native), logits(exact)
    assert float((got - want).norm() / want.norm()) < 0.03
    torch_run = load_model(tiny_q4, cpu_int4=True, cpu_kernels="torch")
    assert torch_run.cpu_kernels == "torch" and not any(isinstance(m, KQuantCpuLinear) for m in torch_run.model.modules())


@needs_cc
@pytest.mark.parametrize("tied", [False, True])
def test_a_stored_output_layer_runs_native_with_its_top_logits_exact(tied, smollm2_gguf, tmp_path):
    """The head's one kernel pass is within its bound everywhere, the greedy token and the logits that could be the
    largest are the float32 product of the stored weights, and a verify pass's rows equal the one-row calls'."""
    path = write_tiny_gguf(tmp_path / "head.gguf", smollm2_gguf, T.Q8_0, tied=tied)
    loaded = load_model(path, cpu_int4=True, cpu_kernels="native", narrow_head="int8")
    head = loaded.model.lm_head
    assert isinstance(head, KQuantHead) and head.kinds == ["a8"]
    assert not isinstance(load_model(path, cpu_int4=True, cpu_kernels="torch", narrow_head="int8").model.lm_head,
                          KQuantHead)
    x = torch.randn(7, head.in_features, generator=torch.Generator().manual_seed(0)) * 3  # [M, H]
    x[2, 5] = 400.0  # an outlier: its block's step is coarse, the bound says so
    want = x.double() @ head.dequantized().double().t()  # [M, V]
    got = head(x)
    top = want.argmax(-1)
    assert torch.equal(got.argmax(-1), top)
    assert torch.allclose(got.gather(1, top[:, None]).double(), want.gather(1, top[:, None]), rtol=1e-5, atol=1e-5)
    alone = torch.cat([head(x[i:i + 1]) for i in range(7)])
    assert torch.equal(alone, got)

