"""A quantized KV cache (int8, int4, k8v4) on a hybrid (Qwen3.5 / 3.6): the gated attention layers' keys and values
stored as codes, minus their calibrated key offsets and Hadamard-rotated as the dense models' are. The fused decode
step (its kernels through Triton's interpreter, and their references) against the eager model path on the same
cache type, the quantized cache against the float one (close, not equal), speculation's rollback, the offload."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel module is first imported
pytest.importorskip("triton")

from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources.hybrid_config import HybridConfig  # noqa: E402
from engine.sources.model_config import ModelConfig  # noqa: E402
from engine.weights.loader import load_dummy  # noqa: E402

PROMPT = [(i * 37 + 11) % 256 for i in range(13)]
OTHER = [(i * 53 + 5) % 256 for i in range(7)]


@pytest.fixture(scope="module")
def loaded():
    """Generated float32 weights, head_dim 64 (int4 rows quantize each rotary half by whole groups of 32), partial
    rotary over 16 of the 64 values; the DeltaNet gates and conv made non-trivial."""
    hc = HybridConfig(("linear_attention", "full_attention", "linear_attention", "full_attention"), 2, 4, 16, 16)
    cfg = ModelConfig(architecture="qwen35", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=256,
                      hybrid=hc)
    loaded = load_dummy(cfg, "tiny", "cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            gen = torch.Generator().manual_seed(len(name))
            if name.endswith(("conv_weight", "A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "k_norm" in name or "q_norm" in name:  # keys with a shared component: what the offset takes
                p.copy_(1 + torch.randn(p.shape, generator=gen))
    return loaded


def _decode(runner, steps: int = 3) -> list[torch.Tensor]:
    """Logits of two slots prefilled with PROMPT and OTHER, then decoded together `steps` times."""
    a, b = runner.slot(0), runner.slot(1)
    out = [runner.prefill(a, PROMPT), runner.prefill(b, OTHER)]
    for i in range(steps):
        out.append(runner.decode_batch([a, b], [(7 * i + 1) % 256, (11 * i + 3) % 256]))  # [2, V]
    return out


@pytest.mark.parametrize("kv_type, kernels", [("int8", False), ("int4", False), ("k8v4", False), ("k8v4", True)],
                         ids=["int8-references", "int4-references", "k8v4-references", "k8v4-kernels"])
def test_the_fused_step_reads_and_writes_the_codes_as_the_eager_path(loaded, kv_type, kernels, monkeypatch):
    """The kernels in the interpreter take ~45 s a cache type: k8v4 has both code formats (int8 keys, int4 values)."""
    if kernels and torch.cuda.is_available():
        pytest.skip("with a GPU the kernels run compiled (tests/perf/gpu_hybrid_kv.py)")
    if kernels:
        monkeypatch.setenv("BONSAI_KERNELS_ON_CPU", "1")
    fused = ModelRunner(loaded, max_seq_len=32, num_slots=2, prefill_chunk_size=8, fast_decode=True, kv_type=kv_type)
    eager = ModelRunner(loaded, max_seq_len=32, num_slots=2, prefill_chunk_size=8, fast_decode=False, kv_type=kv_type)
    assert fused.decoder is not None and fused.decoder.ops.fast == kernels and eager.decoder is None
    offset = fused.cache.key_offset  # [attention layers, KV, D]: calibrated on this model's keys
    assert offset.shape == (2, 2, 64) and offset.abs().amax() > 0.1
    for got, want in zip(_decode(fused), _decode(eager)):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    for name, t in fused.cache.tensors.items():  # the codes each path wrote
        e = eager.cache.tensors[name]
        if t.dtype == torch.float16:
            torch.testing.assert_close(t, e, rtol=2e-3, atol=0)
        else:
            assert (t.int() - e.int()).abs().max() <= 1 and (t != e).float().mean() <= 0.01, name


@pytest.mark.parametrize("kv_type, at_most", [("int8", 2e-5), ("k8v4", 2e-3), ("int4", 5e-3)])
def test_a_quantized_cache_is_close_to_the_float_one(loaded, kv_type, at_most):
    """Against bf16 KV (float32 here: the float cache of the model's dtype): the largest KL divergence of the next
    token's distribution over the prompt passes and decode steps (random weights: 1.8e-3 int4, 6.6e-4 k8v4, 6.4e-6
    int8 measured), never zero (the codes are really read)."""
    base = _decode(ModelRunner(loaded, max_seq_len=32, num_slots=2, fast_decode=False))
    quant = _decode(ModelRunner(loaded, max_seq_len=32, num_slots=2, fast_decode=False, kv_type=kv_type))
    for got, want in zip(quant, base):
        p = torch.log_softmax(want, -1)
        kl = (p.exp() * (p - torch.log_softmax(got, -1))).sum(-1).max().item()
        assert 0 < kl <= at_most, (kv_type, kl)


class _HalfRight:
    """Proposes the plain run's next two tokens, then a wrong one: each verify accepts two and rejects one."""
    hidden_layers = ()
    name = "half-right"

    def __init__(self, prompt: list[int], truth: list[int]):
        self.prompt, self.truth = prompt, truth

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        from engine.speculative.drafter import Draft
        done = len(context) - len(self.prompt)
        right = self.truth[done:done + 2]
        return Draft((right + [(right[-1] + 1) % 256] if right else [])[:k], source=self.name)

    def observe(self, feedback):
        pass


def test_greedy_with_speculation_equals_plain_decoding_on_an_int8_cache(loaded, one_thread):
    """Verify passes write codes past the accepted rows; the rollback leaves the later writes unread."""
    from tests.engine_runs import run_engine
    from tests.test_spec_generate import TinyTokenizer
    tok, request = TinyTokenizer(), dict(max_tokens=24, ignore_eos=True)
    prompt = [3, 17, 42, 9] * 3 + [5]
    plain = run_engine(ModelRunner(loaded, 96, kv_type="int8"), tok, prompt, **request)
    spec = run_engine(ModelRunner(loaded, 96, kv_type="int8"), tok, prompt, drafter=_HalfRight(prompt, plain[1]),
                      k=4, **request)
    stats = spec[3].speculative
    assert spec[1] == plain[1] and stats.drafted > 0 and 0 < stats.accepted < stats.drafted, stats


def test_an_offloaded_int4_cache_equals_the_resident_one(loaded):
    resident = _decode(ModelRunner(loaded, max_seq_len=32, num_slots=2, kv_type="int4"))
    offloaded = ModelRunner(loaded, max_seq_len=32, num_slots=2, kv_type="int4", kv_offload=True)
    assert offloaded.cache.num_layers == 2
    for got, want in zip(_decode(offloaded), resident):
        assert torch.equal(got, want)
