"""The Triton chunked gated delta rule (engine.kernels.deltanet_prefill) against the torch chunked and
recurrent references, in Triton's interpreter (fp32, small shapes)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.deltanet_prefill import chunk_gated_delta_rule_triton, prefill_scratch_bytes  # noqa: E402
from engine.runtime.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402


def _inputs(b, t, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, hk, dk, generator=gen), torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * 0.5  # log decay ≤ 0
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 5, 64, 70, 130])
def test_matches_the_recurrent_and_chunked_references(t):
    q, k, v, g, beta, state = _inputs(2, t, 2, 4, 16, 32, seed=t)
    out, final = chunk_gated_delta_rule_triton(q, k, v, g, beta, state.clone())
    ref, ref_state, _ = recurrent_gated_delta_rule(q, k, v, g, beta, state.clone())
    chunked, chunk_state = chunk_gated_delta_rule(q, k, v, g, beta, state.clone())
    assert out.shape == ref.shape == (2, t, 4, 32)
    assert (out - ref).abs().max() < 1e-4 and (final - ref_state).abs().max() < 1e-4
    assert (out - chunked).abs().max() < 1e-4 and (final - chunk_state).abs().max() < 1e-4


def test_strided_inputs_and_odd_dims():
    """q/k/v as views of one [B, T, C] projection (the conv's output), head dims not powers of two."""
    b, t, hk, hv, dk, dv = 1, 67, 1, 2, 24, 20
    mixed = torch.randn(b, t, 2 * hk * dk + hv * dv)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(b, t, hk, dk), k.view(b, t, hk, dk), v.view(b, t, hv, dv)
    _, _, _, g, beta, state = _inputs(b, t, hk, hv, dk, dv)
    out, final = chunk_gated_delta_rule_triton(q, k, v, g, beta, state.clone())
    ref, ref_state, _ = recurrent_gated_delta_rule(q, k, v, g, beta, state.clone())
    assert (out - ref).abs().max() < 1e-4 and (final - ref_state).abs().max() < 1e-4


def test_scratch_bytes_count_what_the_wrapper_allocates(monkeypatch):
    made = []
    real = torch.empty

    def counting(*shape, **kw):
        x = real(*shape, **kw)
        made.append(x.numel() * x.element_size())
        return x
    q, k, v, g, beta, state = _inputs(2, 70, 2, 4, 16, 32)
    monkeypatch.setattr(torch, "empty", counting)
    chunk_gated_delta_rule_triton(q, k, v, g, beta, state)
    monkeypatch.setattr(torch, "empty", real)
    assert sum(made) == prefill_scratch_bytes(2, 70, 4, 16, 32)
