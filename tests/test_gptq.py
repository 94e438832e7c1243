"""GPTQ: pure maths on random layers with correlated inputs."""
from __future__ import annotations

import pytest
import torch

from quant.grids import dequantize
from quant.gptq import (GRIDS, asymmetric_target, code_range, gptq_quantize, gptq_with_refits, refit_scales, round_with_scale,
                        row_errors, rtn)


pytestmark = pytest.mark.usefixtures("one_thread")


def correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """x = z (I + A): strongly correlated features, like a real layer's inputs. [T, K]"""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(width) + torch.randn(width, width, generator=gen) / width ** 0.5
    scale = torch.rand(width, generator=gen) * 2 + 0.1  # uneven feature magnitudes
    return (torch.randn(tokens, width, generator=gen) @ mix) * scale


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x.double() @ (w - w_hat).double().T).pow(2).sum())


def reference_gptq(w: torch.Tensor, hessian: torch.Tensor, grid: str, group_size: int, damp: float) -> torch.Tensor:
    """GPTQ written the slow, obvious way: one column at a time, updating all later columns at once."""
    w = w.double().clone()
    h = hessian.double().clone()
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    codes = torch.zeros_like(w)
    scale = None
    for i in range(w.shape[1]):
        if i % group_size == 0:
            scale = rtn(w[:, i:i + group_size].float(), grid, group_size)[1][:, 0].double()
        codes[:, i] = round_with_scale(w[:, i], scale, grid)
        err = (w[:, i] - codes[:, i] * scale) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]
    return codes.to(torch.int8)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_the_layer_output(grid, act_order):
    x = correlated_inputs(2048, 256)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    codes, scales = gptq_quantize(w, x.T @ x, grid, group_size=64, act_order=act_order, block_size=48)
    assert codes.dtype == torch.int8 and codes.shape == (96, 256)
    assert scales.dtype == torch.float32 and scales.shape == (96, 4)
    lo, hi = code_range(grid)
    allowed = {-1, 1} if grid == "bin" else set(range(lo, hi + 1))
    assert set(codes.unique().tolist()) <= allowed
    rtn_codes, rtn_scales = rtn(w, grid, 64)
    ours = output_error(x, w, dequantize(codes, scales, 64))
    baseline = output_error(x, w, dequantize(rtn_codes, rtn_scales, 64))
    assert ours < 0.9 * baseline, (grid, ours / baseline)


@pytest.mark.parametrize("grid", ["tri", "bin", "int4"])
def test_lazy_blocks_match_the_column_by_column_reference(grid):
    x = correlated_inputs(1024, 128, seed=3)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    h = x.T @ x
    expected = reference_gptq(w, h, grid, 32, 0.01)
    for block_size in (128, 48, 1):  # blocks that straddle groups too
        codes, _ = gptq_quantize(w, h, grid, group_size=32, block_size=block_size)
        assert int((codes != expected).sum()) <= 2, block_size  # of 4096: float32 vs float64 near-ties only


def test_dead_inputs_are_harmless():
    x = correlated_inputs(512, 64)
    x[:, [3, 40]] = 0.0  # inputs that are never active: H[i, i] = 0
    w = torch.randn(16, 64)
    codes, scales = gptq_quantize(w, x.T @ x, "int4", group_size=32)
    assert torch.isfinite(scales).all()
    assert torch.all(codes[:, [3, 40]] == 0)
    assert output_error(x, w, dequantize(codes, scales, 32)) < output_error(x, w, dequantize(*rtn(w, "int4", 32), 32))


def test_identity_hessian_reduces_to_rtn_for_int8():
    w = torch.randn(8, 64)
    codes, scales = gptq_quantize(w, torch.eye(64), "int8", group_size=64)
    rtn_codes, rtn_scales = rtn(w, "int8", 64)
    assert torch.equal(codes, rtn_codes) and torch.allclose(scales, rtn_scales)


def test_bad_arguments():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown quantization grid"):
        gptq_quantize(w, torch.eye(64), "int3")
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(w, torch.eye(64), "tri", group_size=48)
    with pytest.raises(ValueError, match="Hessian has shape"):
        gptq_quantize(w, torch.eye(32), "tri", group_size=32)


@pytest.mark.parametrize("grid", ["tri", "bin", "int4"])
def test_refit_scales_is_the_least_squares_solution_and_never_worse(grid):
    x = correlated_inputs(512, 64, seed=3)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    h = x.T @ x
    codes, scales = gptq_quantize(w, h, grid, 16, damp=1e-6)
    new = refit_scales(w, codes, scales, h, 16, damp=1e-6)
    before = output_error(x, w, dequantize(codes, scales, 16))
    after = output_error(x, w, dequantize(codes, new, 16))
    assert after < before
    for row in range(3):  # each row's scales solve min ||X (w − V s)||² (V: the row's code values by group)
        v = torch.zeros(64, 4, dtype=torch.float64)
        for g in range(4):
            v[g * 16:(g + 1) * 16, g] = codes[row, g * 16:(g + 1) * 16].double()
        best = torch.linalg.lstsq(x.double() @ v, (x.double() @ w[row].double())[:, None]).solution[:, 0]
        assert torch.allclose(new[row].double(), best, rtol=1e-3, atol=1e-6)
    codes2, kept = gptq_quantize(w, h, grid, 16, damp=1e-6, scales=new)  # GPTQ for given scales keeps them
    assert torch.equal(kept, new) and not torch.equal(codes2, codes)
    for refits in (1, 3):  # rounds of refit + GPTQ: every row at least as good as plain GPTQ's, the layer better
        c, sc = gptq_with_refits(w, h, grid, 16, damp=1e-6, refits=refits)
        assert (row_errors(w, c, sc, h, 16) <= row_errors(w, codes, scales, h, 16) * (1 + 1e-9)).all()
        assert output_error(x, w, dequantize(c, sc, 16)) <= after * (1 + 1e-6)


def test_refit_scales_keeps_rows_it_cannot_improve():
    x = correlated_inputs(256, 32, seed=5)
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(6))
    h = x.T @ x
    codes, scales = gptq_quantize(w, h, "tri", 16)
    codes[0, :16] = 0  # an empty group: its scale is left as it was
    new = refit_scales(w, codes, scales, h, 16)
    assert new[0, 0] == scales[0, 0]
    assert torch.equal(refit_scales(w, codes, new, h, 16)[1:], refit_scales(w, codes, new, h, 16)[1:])
    flipped = -codes  # codes pointing the wrong way: a better fit needs negative scales, which are refused
    assert torch.equal(refit_scales(w, flipped, scales, h, 16), scales)


def test_asymmetric_target_is_the_least_squares_fit_to_the_float_outputs():
    """W' = W + W D H̃⁻¹ minimises Σ ‖W' x̃ − W x‖² (x̃ the quantized model's inputs, x the float model's)."""
    gen = torch.Generator().manual_seed(3)
    x = correlated_inputs(512, 48, seed=1)  # [T, K] the float model's inputs
    x_q = x + 0.3 * correlated_inputs(512, 48, seed=2)  # [T, K] the quantized model's
    w = torch.randn(20, 48, generator=gen)  # [N, K]
    hessian = (x_q.T @ x_q).double()  # [K, K]
    cross = w.double() @ ((x - x_q).T @ x_q).double()  # [N, K] = W D
    goal = asymmetric_target(w, cross, hessian, damp=1e-9)
    best = torch.linalg.lstsq(x_q.double(), (x @ w.T).double()).solution.T  # [N, K]
    torch.testing.assert_close(goal.double(), best, rtol=1e-5, atol=1e-5)
    err = lambda v: float((x_q.double() @ v.double().T - (x @ w.T).double()).pow(2).sum())  # noqa: E731
    assert err(goal) < 0.9 * err(w)
    half = asymmetric_target(w, cross, hessian, damp=1e-9, strength=0.5)
    torch.testing.assert_close(half.double(), (w.double() + best) / 2, rtol=1e-5, atol=1e-5)


def test_asymmetric_target_without_a_mismatch_is_the_weights():
    x = correlated_inputs(256, 32)  # [T, K]
    x[:, 5] = 0.0  # a dead input
    w = torch.randn(8, 32)  # [N, K]
    hessian = (x.T @ x).double()
    assert torch.equal(asymmetric_target(w, torch.zeros(8, 32), hessian, 0.01), w)
    assert torch.equal(asymmetric_target(w, torch.randn(8, 32), hessian, 0.01, strength=0.0), w)
    moved = asymmetric_target(w, torch.randn(8, 32), hessian, 0.01)
    assert torch.equal(moved[:, 5], w[:, 5])  # a dead input's weights are left as they are
