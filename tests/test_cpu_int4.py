"""GGUF 4-bit matrices on the CPU as stored (quant.gguf_int4, engine.runtime.cpu_int4) and the float16
output layer with exact top logits (engine.runtime.narrow_head): the maths without a model, then a tiny
GGUF through load_model and the run config."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from engine.run.config import RunConfig
from engine.runtime.cpu_int4 import VERIFY_ROWS, Int4CpuLinear, int4_matmul, unpack_codes
from engine.runtime.narrow_head import (Int8Head, NarrowHead, fp16_gemm_bound_holds, int8_head_usable,
                                        narrow_output_layer)
from engine.weights.loader import load_model
from quant.gguf_int4 import INT4_TYPES, affine_weights, decode_int4
from tests.gguf_tiny import random_k_quant_bytes, write_tiny_gguf


def _raw(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == T.Q4_K:
        raw = random_k_quant_bytes(rng, qtype, rows, cols)  # every scale / min / code pattern, d = dmin = 0.002
        d = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 2)).astype(np.float16)  # varied d and dmin
        blocks = raw.reshape(rows, cols // 256, 144)
        blocks[..., 0:4] = d.view(np.uint8).reshape(rows, cols // 256, 4)
        return blocks.reshape(rows, -1)
    w = (rng.standard_normal((rows, cols)) * 0.05 + (0.02 if qtype == T.Q4_1 else 0.0)).astype(np.float32)
    return gguf_quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_blocks_decode_to_the_reference_dequantizer_values(qtype):
    raw = _raw(qtype, 48, 512)
    codes, s, z = decode_int4(raw, int(qtype), 512)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and codes.shape == (48, 512)
    assert s.shape == z.shape == (48, 512 // 32)
    ref = torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(48, 512).astype(np.float32))
    got = affine_weights(codes, s, z)
    # (q − 8)·s + z rounds once more than d·q − m in float32 (Q4_1, Q4_K): within a few ulps
    assert torch.allclose(got, ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(ref.abs().max()))
    if qtype == T.Q4_0:
        assert torch.equal(got, ref)


def test_a_row_that_does_not_hold_whole_blocks_is_refused():
    raw = _raw(T.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="bytes per row"):
        decode_int4(raw, int(T.Q4_0), 96)
    assert set(INT4_TYPES) == {int(T.Q4_0), int(T.Q4_1), int(T.Q4_K)}


def _layer(n: int = 96, k: int = 256, seed: int = 0, bias: bool = False) -> tuple[Int4CpuLinear, torch.Tensor]:
    codes, s, z = decode_int4(_raw(T.Q4_K, n, k, seed), int(T.Q4_K), k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    return Int4CpuLinear(codes, s, z, b), codes


def test_the_int4_layer_multiplies_by_its_stored_weights():
    layer, codes = _layer(bias=True)
    assert torch.equal(unpack_codes(layer.packed, 96, 256), codes)  # the packed layout holds the codes
    x = torch.randn(3, 5, 256)  # [B, T, K]
    w = layer.dequantized()  # float32 of the bfloat16 pairs
    ref = x.to(torch.bfloat16).float() @ w.t() + layer.bias  # [B, T, N]
    got = layer(x)
    assert got.shape == (3, 5, 96) and got.dtype == torch.float32
    # bfloat16 output rounding: 2^-8 of each value, plus float32 summation order
    assert torch.allclose(got, ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))
    assert layer.nbytes == 96 * 256 // 2 + 96 * 256 // 32 * 2 * 2


def test_a_verify_pass_row_equals_the_one_row_step_bit_for_bit():
    layer, _ = _layer(n=160, k=512, seed=3)
    x = torch.randn(VERIFY_ROWS, 512)  # [M, K]
    alone = torch.cat([layer(x[i:i + 1]) for i in range(VERIFY_ROWS)])  # [M, N]
    for m in (2, 3, 5, 8, VERIFY_ROWS):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    layer.split_rows = True  # the path taken on a CPU whose kernel mixes rows: the same values
    assert torch.equal(layer(x[:5]), alone[:5])


def test_int4_matmul_takes_bfloat16_pairs():
    layer, _ = _layer()
    y = int4_matmul(torch.randn(2, 256), layer.packed, layer.sz)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 96)


def _head(vocab: int = 3000, hidden: int = 192, seed: int = 0) -> tuple[NarrowHead, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.05).half().float()  # exact in float16
    return NarrowHead(w), w


def test_the_float16_head_keeps_the_greedy_choice_and_the_top_logits_exact():
    head, w = _head()
    x = torch.randn(64, 192) * 3  # [M, H]
    exact = x @ w.t()  # [M, V]
    got = head(x)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.argmax(-1)
    rows = torch.arange(64)
    assert torch.allclose(got[rows, top], exact[rows, top], rtol=0, atol=1e-5)  # recomputed in float32
    assert (got - exact).abs().max() <= 2 ** -10 * exact.abs().max() + 0.05  # the rest: float16's rounding


def test_a_near_tie_below_float16_resolution_is_resolved_as_float32_resolves_it():
    hidden = 64
    w = torch.zeros(4, hidden)
    w[:, 0] = 1.0
    w[1, 1] = 2.0 ** -14  # token 1 beats token 0 by 2^-14·x1: invisible in a float16 logit near 16
    w[2, 0] = 0.5
    head = NarrowHead(w)
    x = torch.zeros(1, hidden)
    x[0, 0], x[0, 1] = 16.0, 1.0
    fp16 = torch.nn.functional.linear(x.half(), w.half()).float()
    assert fp16[0, 0] == fp16[0, 1]  # a tie in float16
    got = head(x)
    assert int(got.argmax()) == 1 and float(got[0, 1] - got[0, 0]) == pytest.approx(2.0 ** -14)


def test_the_head_gives_each_row_the_same_top_in_a_verify_pass():
    head, _ = _head(seed=1)
    x = torch.randn(9, 192) * 3
    alone = torch.cat([head(x[i:i + 1]) for i in range(9)])  # [M, V]
    together = head(x)
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    top = alone.argmax(-1)
    assert torch.equal(together[torch.arange(9), top], alone[torch.arange(9), top])


def test_an_activation_beyond_float16_range_falls_back_to_float32():
    head, w = _head(vocab=50, hidden=16)
    x = torch.full((1, 16), 7e4)
    assert torch.allclose(head(x), x @ w.t(), rtol=1e-5)


needs_int8 = pytest.mark.skipif(not int8_head_usable(), reason="torch's int8-weight kernel is slow here (no AVX512)")


@needs_int8
def test_the_int8_head_keeps_the_float16_heads_greedy_choice_and_top_logits():
    """Int8Head: one int8-weight GEMM, then every logit within its bound of the row's largest recomputed from the
    float16 weights: the top logits exactly the float32 product's, the rest within the bound (and close)."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(3000, 192, generator=gen) * 0.05 * torch.rand(3000, 1, generator=gen)).half().float()
    head = Int8Head(w)
    assert head.codes.dtype == torch.int8 and head.scales.dtype == torch.bfloat16
    x = torch.randn(64, 192, generator=gen) * 3  # [M, H]
    exact = x @ w.t()  # [M, V]
    got = head(x)
    top = exact.argmax(-1)
    assert torch.equal(got.argmax(-1), top)
    rows = torch.arange(64)
    assert torch.allclose(got[rows, top], exact[rows, top], rtol=0, atol=1e-5)
    approx, err = head.approximate(x)
    assert ((approx - exact).abs() <= err).all()  # the bound holds for every logit
    assert (got - exact).abs().mean() < 0.1 * err.mean()  # and is not vacuous: typical errors far below it
    recomputed = (approx + err >= (approx - err).amax(-1, keepdim=True)).sum(-1)  # [M]: a few a row
    assert (recomputed >= 1).all() and recomputed.max() < 3000 // 10


@needs_int8
def test_the_int8_head_resolves_a_near_tie_below_its_resolution():
    hidden = 64
    w = torch.zeros(4, hidden)
    w[:, 0] = 1.0
    w[1, 1] = 2.0 ** -14  # token 1 beats token 0 by 2^-14: invisible at int8 / bfloat16
    w[2, 0] = 0.5
    head = Int8Head(w)
    x = torch.zeros(1, hidden)
    x[0, 0], x[0, 1] = 16.0, 1.0
    got = head(x)
    assert int(got.argmax()) == 1 and float(got[0, 1] - got[0, 0]) == pytest.approx(2.0 ** -14)


@needs_int8
def test_the_int8_head_gives_each_row_the_same_top_in_a_verify_pass():
    gen = torch.Generator().manual_seed(3)
    head = Int8Head((torch.randn(3000, 192, generator=gen) * 0.05).half().float())
    x = torch.randn(9, 192, generator=gen) * 3
    alone = torch.cat([head(x[i:i + 1]) for i in range(9)])  # [M, V]
    together = head(x)
    top = alone.argmax(-1)
    assert torch.equal(together.argmax(-1), top)
    assert torch.equal(together[torch.arange(9), top], alone[torch.arange(9), top])


def test_the_output_dtype_setting_picks_the_head(tiny_q4):
    int8 = load_model(tiny_q4, cpu_int4=True, narrow_head="int8", cpu_kernels="torch")
    half = load_model(tiny_q4, cpu_int4=True, narrow_head="float16", cpu_kernels="torch")
    exact = load_model(tiny_q4, cpu_int4=True, cpu_kernels="torch")
    assert type(int8.model.lm_head) is (Int8Head if int8_head_usable() else NarrowHead)
    assert type(half.model.lm_head) is NarrowHead and type(exact.model.lm_head).__name__ == "Linear"
    x = torch.randn(6, exact.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3  # [M, H]
    want = exact.model.lm_head(x)  # [M, V]
    for loaded in (int8, half):  # each row's greedy token and top logit: the float32 head's
        got = loaded.model.lm_head(x)  # [M, V]
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        top = want.argmax(-1)
        assert torch.allclose(got[torch.arange(6), top], want[torch.arange(6), top], rtol=2 ** -10, atol=0)  # float16 w


def test_this_cpu_keeps_the_float16_bound():
    assert fp16_gemm_bound_holds()  # else narrow_output_layer leaves the head float32 (a slower, exact run)


@pytest.fixture(scope="module")
def tiny_q4(smollm2_gguf, tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("q4") / "tiny-q4_1.gguf", smollm2_gguf, T.Q4_1)


def test_a_q4_gguf_loads_its_block_matrices_as_stored(tiny_q4):
    fast = load_model(tiny_q4, cpu_int4=True, narrow_head="float16", cpu_kernels="torch")
    exact = load_model(tiny_q4, weight_dtype=torch.float32)
    assert fast.int4_layers == 2 * 4 and fast.cpu_int4 and exact.int4_layers == 0
    block, ref = fast.model.layers[0], exact.model.layers[0]
    assert isinstance(block.feed_forward.w13, Int4CpuLinear) and isinstance(block.attention.wqkv, Int4CpuLinear)
    # the stored codes and scales, llama q/k rows un-permuted as the float load does (bfloat16 pairs)
    for mine, theirs in ((block.attention.wqkv, ref.attention.wqkv), (block.feed_forward.w2, ref.feed_forward.w2)):
        assert torch.allclose(mine.dequantized(), theirs.weight, rtol=2 ** -7, atol=2e-3)
    assert isinstance(fast.model.lm_head, NarrowHead)
    assert load_model(tiny_q4, cpu_int4=False).int4_layers == 0


def test_narrowing_needs_a_float32_head(tiny_q4):
    loaded = load_model(tiny_q4, weight_dtype=torch.float32)
    assert narrow_output_layer(loaded.model) and not narrow_output_layer(loaded.model)  # once


def test_the_run_config_turns_both_on_by_default_on_the_cpu_only():
    cpu = RunConfig.from_dict({"model": {"path": "x.gguf"}})
    assert cpu.cpu_int4 and cpu.narrow_head == "int8"
    half = RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"output_dtype": "float16"}})
    assert half.narrow_head == "float16"
    exact = RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"weight_dtype": "float32"}})
    assert not exact.cpu_int4 and exact.narrow_head is None
    packed = RunConfig.from_dict({"model": {"path": "x.gguf", "quant_type": "int4"}})
    assert not packed.cpu_int4
    off = RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"cpu_int4": False, "output_dtype": "float32"}})
    assert not off.cpu_int4 and not off.narrow_head
    gpu = RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"device": "cuda"}})
    assert not gpu.cpu_int4 and not gpu.narrow_head


@pytest.mark.parametrize("runtime, match", [({"device": "cuda", "cpu_int4": True}, "runtime.cpu_int4: applies to"),
                                            ({"output_dtype": "half"}, "runtime.output_dtype: 'half' is not one of"),
                                            ({"device": "cuda", "output_dtype": "float16"}, "float16 applies"),
                                            ({"device": "cuda", "output_dtype": "int8"}, "int8 applies")])
def test_bad_settings_are_refused_in_one_line(runtime, match):
    from engine.errors import BonsaiError
    with pytest.raises(BonsaiError, match=match):
        RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": runtime})


def test_greedy_speculation_with_int4_layers_and_the_float16_head_equals_plain_decoding(one_thread):
    """Every block matrix as a Q4_K-coded int4 layer and the output layer narrow: verify rows are the
    decode step's, so n-gram and draft-model speculation give plain decoding's greedy tokens."""
    from engine.runtime.runner import ModelRunner
    from engine.speculative.draft_model import DraftModelDrafter
    from engine.speculative.ngram import NgramDrafter
    from tests.engine_runs import run_engine
    from tests.test_spec_generate import PROMPT, TinyTokenizer, perturbed, tiny_loaded
    loaded = tiny_loaded()
    draft = perturbed(loaded, 0.02)  # from the float weights, before they are coded
    model = loaded.model
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "Linear" and module is not model.lm_head:
            n, k = module.weight.shape
            if k % 32:
                continue
            w = module.weight.detach().float().numpy()
            raw = gguf_quants.quantize(np.ascontiguousarray(w), T.Q4_0)
            codes, s, z = decode_int4(raw, int(T.Q4_0), k)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Int4CpuLinear(codes, s, z, module.bias))
    assert any(isinstance(m, Int4CpuLinear) for m in model.modules())
    assert narrow_output_layer(model)
    tok, request = TinyTokenizer(), dict(max_tokens=40, ignore_eos=True)
    _, plain, _, _ = run_engine(ModelRunner(loaded, 96), tok, PROMPT, **request)
    for drafter in (NgramDrafter(1, 3), DraftModelDrafter(draft, loaded.config.vocab_size, 96)):
        _, ids, _, stats = run_engine(ModelRunner(loaded, 96), tok, PROMPT, **request, drafter=drafter, k=4)
        assert ids == plain
        assert stats.speculative.drafted > 0
