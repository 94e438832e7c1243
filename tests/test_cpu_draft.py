"""A draft model on the CPU with every matrix as 4-bit codes (engine.speculative.cpu_draft): the rounding
maths without a model (quant.gguf_int4.affine_rtn), the conversion of a tiny model (untied and tied output
layer), speculation with it giving plain decoding's greedy tokens, the setting that turns it off, and the
bfloat16 default of the matrices left beside a GGUF's 4-bit ones (engine.weights.loader.default_weight_dtype)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.errors import BonsaiError
from engine.runtime.cpu_int4 import Int4CpuLinear, int4_kernel_available
from engine.runtime.linear import cpu_bf16_gemm
from engine.runtime.runner import ModelRunner
from engine.speculative import cpu_draft
from engine.speculative.config import SpeculativeConfig
from engine.speculative.cpu_draft import four_bit_drafter
from engine.speculative.draft_model import DraftModelDrafter
from engine.weights.loader import default_weight_dtype
from quant.gguf_int4 import GROUP, affine_rtn, affine_weights
from tests.engine_runs import run_engine
from tests.test_spec_generate import PROMPT, TinyTokenizer, perturbed, tiny_loaded

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="this torch has no CPU int4 kernel")


def test_rounding_keeps_each_group_within_half_a_step_and_its_ends_exact():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen)  # [N, K]: rows of varied scale
    w[3, :GROUP] = 0.25  # a constant group: exact, no division by a zero step
    codes, s, z = affine_rtn(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and codes.shape == w.shape
    assert s.shape == z.shape == (48, 256 // GROUP) and bool((s > 0).all())
    back = affine_weights(codes, s, z)  # [N, K]
    step = s.repeat_interleave(GROUP, dim=1)  # [N, K]
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())
    groups, got = w.view(48, -1, GROUP), back.view(48, -1, GROUP)  # [N, K/32, 32]
    assert torch.allclose(got.amin(-1), groups.amin(-1), atol=1e-6)  # code 0 is the minimum
    assert torch.allclose(got.amax(-1), groups.amax(-1), atol=1e-6)  # code 15 the maximum
    assert torch.equal(back[3, :GROUP], w[3, :GROUP])


@needs_int4
def test_every_matrix_of_a_cpu_draft_model_becomes_4_bit_and_it_still_drafts(one_thread):
    target = tiny_loaded(vocab=112)  # 112 rows: the kernel packs rows in sixteens
    draft = perturbed(target, 0.02)
    def logits() -> torch.Tensor:
        runner = ModelRunner(draft, 32)
        return runner.forward(runner.slot(0), PROMPT, num_logits=len(PROMPT))  # [T, V]

    before = logits()
    assert four_bit_drafter(draft) == 2 * 4 + 1  # q/k/v, o, gate/up, down of each block, and the output layer
    linears = [m for m in draft.model.modules() if type(m).__name__ in ("Linear", "Int4CpuLinear")]
    assert linears and all(isinstance(m, Int4CpuLinear) and m.halves == 1 for m in linears)
    after = logits()
    cosine = torch.nn.functional.cosine_similarity(after, before, dim=-1)  # [T]
    assert bool((cosine > 0.95).all()), cosine  # rounded (4 bits of a random model: ~10% a logit), not broken
    assert four_bit_drafter(draft) == 0  # already 4-bit: nothing left to round
    tok, request = TinyTokenizer(), dict(max_tokens=32, ignore_eos=True)
    _, plain, _, _ = run_engine(ModelRunner(target, 96), tok, PROMPT, **request)
    drafter = DraftModelDrafter(draft, target.config.vocab_size, 96)
    _, ids, _, stats = run_engine(ModelRunner(target, 96), tok, PROMPT, **request, drafter=drafter, k=4)
    assert ids == plain  # verification keeps the output exact whatever the drafter's rounding
    assert stats.speculative.accepted > 0


@needs_int4
def test_a_tied_output_layer_gets_its_own_4_bit_copy_and_the_lookup_stays():
    loaded = tiny_loaded(vocab=112)
    model = loaded.model
    model.lm_head = None  # tied: the output layer reads the embedding
    table = model.embed.weight.detach().clone()
    assert four_bit_drafter(loaded) == 2 * 4 + 1
    assert isinstance(model.lm_head, Int4CpuLinear) and torch.equal(model.embed.weight, table)
    h = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(1))  # [M, H]
    assert torch.allclose(model.lm_head(h), h @ table.t(), atol=0.15 * float((h @ table.t()).abs().max()))


def test_nothing_is_rounded_without_the_cpu_kernel(monkeypatch):
    monkeypatch.setattr(cpu_draft, "int4_kernel_available", lambda: False)
    loaded = tiny_loaded(vocab=112)
    assert four_bit_drafter(loaded) == 0
    assert not any(isinstance(m, Int4CpuLinear) for m in loaded.model.modules())
    meta = replace(tiny_loaded(vocab=112), device=torch.device("meta"))
    monkeypatch.setattr(cpu_draft, "int4_kernel_available", lambda: True)
    assert four_bit_drafter(meta) == 0  # a draft model on another device is left as it is


def test_the_draft_weights_setting_is_checked_and_reaches_the_config():
    from engine.run.config import RunConfig
    assert SpeculativeConfig.from_spec("draft:x").draft_weights == "auto"
    with pytest.raises(BonsaiError, match="draft_weights must be auto .* or stored"):
        SpeculativeConfig.from_spec("draft:x", draft_weights="int4")
    run = RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"decode_algorithm": "speculative"},
                               "speculative": {"method": "draft:y.gguf", "draft_weights": "stored"}})
    assert run.speculative.as_spec_config().draft_weights == "stored"
    with pytest.raises(BonsaiError, match="draft_weights"):
        RunConfig.from_dict({"model": {"path": "x.gguf"}, "runtime": {"decode_algorithm": "speculative"},
                             "speculative": {"method": "draft:y.gguf", "draft_weights": "int8"}})


@needs_int4
@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("weights", ["auto", "stored"])
def test_a_draft_model_file_loads_as_the_setting_says(weights, kernels, tiny_q4_gguf):
    """The drafter follows the target's CPU kernels: torch's int4 layers, or the native kernels' 4-bit form."""
    from engine.runtime.cpu_kquant import KQuantCpuLinear
    from engine.speculative.config import build_drafter
    from engine.weights.loader import load_model
    from quant.kernels import cpu_rt
    if kernels == "native" and cpu_rt.library() is None:
        pytest.skip("no C compiler for the native kernels")
    target = load_model(tiny_q4_gguf, cpu_int4=True, narrow_head="int8", cpu_kernels=kernels)
    config = SpeculativeConfig.from_spec(f"draft:{tiny_q4_gguf}", draft_weights=weights, adaptive=False)
    drafter = build_drafter(config, target, 64)
    assert drafter.loaded.cpu_kernels == kernels
    head = drafter.loaded.model.lm_head
    four_bit = KQuantCpuLinear if kernels == "native" else Int4CpuLinear
    assert isinstance(head, four_bit) == (weights == "auto")
    if kernels == "native" and weights == "auto":
        assert head.kinds == ["a4"]
        assert all(set(m.kinds) <= {"a4", "q4k"} for m in drafter.loaded.model.modules()
                   if isinstance(m, KQuantCpuLinear))
    if weights == "stored":  # the output layer narrowed as before: int8 codes, or float16
        assert head.weight.dtype in (torch.int8, torch.float16)


@pytest.fixture(scope="module")
def tiny_q4_gguf(smollm2_gguf, tmp_path_factory):
    from gguf import GGMLQuantizationType as T
    from tests.gguf_tiny import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("draft") / "tiny-q4_0.gguf", smollm2_gguf, T.Q4_0)


def test_matrices_beside_4_bit_ones_are_bfloat16_where_the_cpu_multiplies_it(monkeypatch):
    from engine.weights import loader
    cpu = torch.device("cpu")
    assert default_weight_dtype(cpu, torch.float32) == torch.float16  # no 4-bit matrices: the float16 gemv
    assert default_weight_dtype(cpu, torch.float32, int4=True) == (torch.bfloat16 if cpu_bf16_gemm() else torch.float16)
    monkeypatch.setattr(loader, "cpu_bf16_gemm", lambda: False)
    assert default_weight_dtype(cpu, torch.float32, int4=True) == torch.float16
    monkeypatch.setattr(loader, "cpu_bf16_gemm", lambda: True)
    assert default_weight_dtype(cpu, torch.float32, int4=True) == torch.bfloat16
    assert default_weight_dtype(torch.device("cuda"), torch.bfloat16, int4=True) == torch.bfloat16
