"""A CPU verify pass attends row by row over each row's visible keys (engine.runtime.cpu_attention), so its rows'
logits are the one-row decode step's bit for bit; speculation then keeps plain greedy output at any near-tie."""
from __future__ import annotations

import pytest
import torch

from engine.runtime import cpu_attention
from engine.runtime.cpu_attention import rowwise_attention
from engine.runtime.runner import ModelRunner
from engine.runtime.linear import Linear
from tests.test_spec_generate import tiny_loaded


def narrow_tiny():
    """The tiny model with float16 matrices (the CPU's gemv per row: products row-independent, so attention is
    what is tested), the output layer too."""
    loaded = tiny_loaded()
    for module in loaded.model.modules():
        if isinstance(module, Linear):
            module.weight.data = module.weight.data.half()
    return loaded


def _decode_then_verify(loaded, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    runner = ModelRunner(loaded, 256)
    slot = runner.slot(0)
    runner.forward(slot, prompt)
    steps = torch.cat([runner.forward(slot, [t]) for t in tokens])  # [T, V]: one row each
    runner = ModelRunner(loaded, 256)
    slot = runner.slot(0)
    runner.forward(slot, prompt)
    return steps, runner.forward(slot, tokens, num_logits=len(tokens))  # [T, V] in one pass


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_verify_rows_equal_the_decode_steps_bit_for_bit(one_thread, rows):
    loaded = narrow_tiny()
    gen = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, 97, (150,), generator=gen).tolist()  # more keys than the flash kernel's blocks
    tokens = torch.randint(0, 97, (rows,), generator=gen).tolist()
    steps, verify = _decode_then_verify(loaded, prompt, tokens)
    assert torch.equal(steps, verify)


def test_the_masked_call_this_replaces_was_not_exact(one_thread, monkeypatch):
    """Without the row-by-row attention the same pass differs from the decode steps (the failure it fixes; if a
    later torch's kernel is row-independent, this documents that the workaround may go)."""
    loaded = narrow_tiny()
    gen = torch.Generator().manual_seed(0)
    prompt, tokens = torch.randint(0, 97, (150,), generator=gen).tolist(), torch.randint(0, 97, (5,), generator=gen).tolist()
    monkeypatch.setattr("engine.runtime.model.EXACT_ROWS", 0)
    steps, verify = _decode_then_verify(loaded, prompt, tokens)
    if torch.equal(steps, verify):
        pytest.skip("this torch's CPU attention is row-independent without the workaround")
    assert (steps - verify).abs().max() > 0


def test_a_mask_that_is_not_a_prefix_is_left_to_the_masked_call():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    mask[0, 0, 1, 2] = False  # a hole: not causal by position
    assert rowwise_attention(q, k, v, mask, True) is None
    mask[0, 0, 1, 2:] = False  # row 1 sees keys 0..1, row 0 all six
    out = rowwise_attention(q, k, v, mask, True)  # [1, 4, 2, 8]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-5)
    assert cpu_attention.EXACT_ROWS >= 16  # a verify pass of k = 15 drafts
