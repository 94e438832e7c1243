"""GSQ learned rounding: pure maths on random layers with correlated inputs."""
from __future__ import annotations

import pytest
import torch

from quant.grids import dequantize
from quant.gptq import code_range, gptq_quantize, rtn
from quant.gsq import (GSQOptions, candidate_codes, full_batch_grad, gsq_refine, lion_step, minibatch_grad,
                       relaxed_gradients)
from tests.test_gptq import correlated_inputs, output_error

FAST = GSQOptions(steps=120, eval_every=20)


pytestmark = pytest.mark.usefixtures("one_thread")


def layer(seed: int = 0, n: int = 64, k: int = 128):
    x = correlated_inputs(1024, k, seed=seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    return x, w


@pytest.mark.parametrize("grid", ["tri", "bin", "int4", "int8"])
def test_gsq_improves_on_gptq_and_stays_on_the_grid(grid):
    x, w = layer()
    codes, scales = gptq_quantize(w, x.T @ x, grid, group_size=32)
    new_codes, new_scales = gsq_refine(w, x, codes, scales, grid, 32, FAST)
    assert new_codes.dtype == torch.int8 and new_codes.shape == codes.shape
    assert new_scales.dtype == torch.float32 and new_scales.shape == scales.shape
    lo, hi = code_range(grid)
    assert set(new_codes.unique().tolist()) <= ({-1, 1} if grid == "bin" else set(range(lo, hi + 1)))
    start = output_error(x, w, dequantize(codes, scales, 32))
    ours = output_error(x, w, dequantize(new_codes, new_scales, 32))
    assert ours <= start * (1 + 1e-9)
    if grid != "int8":  # int8 is already near-lossless: no room for a sure gain
        assert ours < 0.97 * start, (grid, ours / start)
    if grid in ("int4", "int8"):  # up/down rounding only: at most one step from the start code
        assert (new_codes.int() - codes.int()).abs().max() <= 1


def test_never_worse_than_a_start_that_is_already_optimal():
    """Start from a rounding training cannot beat (the exact weights are on the grid): returned as is."""
    x, _ = layer(seed=5)
    codes = torch.randint(-1, 2, (32, 128), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    scales = torch.full((32, 4), 0.03)
    w = dequantize(codes, scales, 32)
    new_codes, new_scales = gsq_refine(w, x, codes, scales, "tri", 32, GSQOptions(steps=40, eval_every=10, lr=0.05))
    assert torch.equal(new_codes, codes) and torch.equal(new_scales, scales)


def test_deterministic_with_a_seed():
    x, w = layer(seed=2)
    codes, scales = rtn(w, "tri", 32)
    a = gsq_refine(w, x, codes, scales, "tri", 32, FAST)
    b = gsq_refine(w, x, codes, scales, "tri", 32, FAST)
    c = gsq_refine(w, x, codes, scales, "tri", 32, GSQOptions(steps=120, eval_every=20, seed=1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_runs_under_inference_mode():
    """The calibration pipeline runs without gradients: GSQ needs none."""
    with torch.inference_mode():
        x, w = layer(seed=3)
        codes, scales = rtn(w, "bin", 32)
        new_codes, _ = gsq_refine(w, x, codes, scales, "bin", 32, GSQOptions(steps=10, eval_every=5))
    assert new_codes.shape == codes.shape


def test_candidates_of_int_grids_are_the_neighbours_of_the_start():
    codes = torch.tensor([[-7, 0, 7]], dtype=torch.int8)
    values, valid = candidate_codes(codes, "int4")
    assert values[:, 0].tolist() == [[-7, -1, 6], [-7, 0, 7], [-6, 1, 7]]
    assert valid[:, 0].tolist() == [[False, True, True], [True, True, True], [True, True, False]]


@pytest.mark.parametrize("grid", ["tri", "int4"])
@pytest.mark.parametrize("objective", ["full", "minibatch"])
def test_written_out_gradients_match_autograd(grid, objective):
    """Both objectives are mean((x Ŵᵀ − x Wᵀ)²); the full one is computed through xᵀx."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-1, 2, (6, 16), generator=gen).to(torch.int8)
    values, _ = candidate_codes(codes, grid)
    values = values.double()
    logits = (0.01 * torch.randn(3, 6, 16, generator=gen, dtype=torch.float64)).requires_grad_(True)
    rel = (1 + 0.1 * torch.rand(6, 2, generator=gen, dtype=torch.float64)).requires_grad_(True)
    start = torch.rand(6, 2, generator=gen, dtype=torch.float64) + 0.5
    gumbel = torch.randn(3, 6, 16, generator=gen, dtype=torch.float64)
    x, w = torch.randn(5, 16, generator=gen, dtype=torch.float64), torch.randn(6, 16, generator=gen, dtype=torch.float64)
    probs = torch.softmax((logits * 150 + gumbel) / 1.3, dim=0)
    w_hat = (probs * values).sum(0) * (start * rel).repeat_interleave(8, dim=1)
    (x @ w_hat.T - x @ w.T).pow(2).mean().backward()
    output_grad = full_batch_grad(w, x.T @ x, 5) if objective == "full" else minibatch_grad(x, x @ w.T)
    grad_logits, grad_scale = relaxed_gradients(logits.detach(), rel.detach(), values, start, gumbel, 150.0, 1.3, 8,
                                                output_grad)
    assert torch.allclose(grad_logits, logits.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(grad_scale, rel.grad, rtol=1e-9, atol=1e-12)


def test_minibatches_work_too():
    x, w = layer(seed=4)
    codes, scales = gptq_quantize(w, x.T @ x, "tri", group_size=32)
    new_codes, new_scales = gsq_refine(w, x, codes, scales, "tri", 32, GSQOptions(batch_size=128, epochs=15, eval_every=20))
    assert output_error(x, w, dequantize(new_codes, new_scales, 32)) < 0.97 * output_error(x, w, dequantize(codes, scales, 32))


def test_lion_step_matches_its_definition():
    p, g, m = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.1, -4.0]), torch.tensor([-1.0, 0.0, 1.0])
    lion_step(p, g, m, lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    # update = sign(0.9 m + 0.1 g) = sign([-0.87, 0.01, 0.5]); p ← p (1 - 0.05) - 0.1 update
    assert torch.allclose(p, torch.tensor([0.95 + 0.1, -1.9 - 0.1, 0.475 - 0.1]))
    assert torch.allclose(m, torch.tensor([-0.99 + 0.003, 0.001, 0.99 - 0.04]))


@pytest.mark.parametrize("bad", [dict(steps=0), dict(lr=0), dict(batch_size=-1), dict(temperature=(2.0, 0.0)),
                                 dict(logit_scale=(-1.0, 5.0)), dict(betas=(0.9, 1.0)), dict(epochs=-1)])
def test_options_are_validated(bad):
    with pytest.raises(ValueError, match="GSQ option"):
        GSQOptions(**bad)


def test_bad_shapes():
    x, w = layer()
    codes, scales = rtn(w, "tri", 32)
    with pytest.raises(ValueError, match="inputs must be"):
        gsq_refine(w, x[:, :64], codes, scales, "tri", 32, FAST)
    with pytest.raises(ValueError, match="shapes do not match"):
        gsq_refine(w, x, codes, scales, "tri", 64, FAST)
