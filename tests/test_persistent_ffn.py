"""The persistent FFN kernel (quant.kernels.persistent_ffn) against today's four-launch path.

On the CPU the kernel runs in Triton's interpreter one phase a launch (the interpreter runs programs one after
another: a grid barrier cannot work there); on a GPU the one-launch form with its grid barriers runs too.
"""
from __future__ import annotations

import pytest
import torch

from quant.kernels.act_quant import quantize_activations_reference
from quant.kernels.gemv_parts import packed_gemv_reference
from quant.kernels.persistent_ffn import (FfnBuffers, launch_config, persistent_ffn, persistent_ffn_reference,
                                          programs_that_fit, supported)
from quant.packed_layout import random_packed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _block(kind: str, hidden: int, inter: int, group: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = random_packed(kind, 2 * inter, hidden, group, generator=gen).to(DEVICE)
    w2 = random_packed(kind, hidden, inter, group, generator=gen).to(DEVICE)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE)  # [1, H]
    norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE)  # [H]
    return x, norm, w13, w2


@pytest.mark.parametrize("kind", ["tri", "bin"])
@pytest.mark.parametrize("programs", [None, 3])
def test_phases_match_the_four_launch_path(kind, programs):
    x, norm, w13, w2 = _block(kind, 256, 384)
    expected = persistent_ffn_reference(x.clone(), norm, 1e-6, w13, w2)
    buffers = FfnBuffers.make(256, 384, 128, DEVICE)
    got = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, buffers, phased=True, programs=programs)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), (got - expected).abs().max()
    # the int8 inputs of both products are act_quant's codes, bit for bit
    xq, sx, sumx = quantize_activations_reference(x, 128, norm, 1e-6)
    assert torch.equal(buffers.xq1, xq[0]) and torch.equal(buffers.sumx1, sumx[0])
    assert torch.allclose(buffers.sx1, sx[0], rtol=0, atol=0)
    gu = packed_gemv_reference(xq, sx, sumx, w13)  # [1, 2F]
    hq, hsx, _ = quantize_activations_reference(gu, 128, gated=True)
    assert (buffers.xq2.int() - hq[0].int()).abs().max() <= 1  # gate/up sums by atomics: a rounding may move
    assert torch.allclose(buffers.sx2, hsx[0], rtol=1e-5)
    assert not buffers.gu.any(), "the gate/up sums are left at zero for the next call"
    assert int(buffers.stuck) == 0


def test_a_second_call_starts_from_clean_buffers():
    x, norm, w13, w2 = _block("tri", 256, 384, seed=3)
    buffers = FfnBuffers.make(256, 384, 128, DEVICE)
    once = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, buffers, phased=True)
    twice = persistent_ffn(once.clone(), norm, 1e-6, w13, w2, buffers, phased=True)
    expected = persistent_ffn_reference(persistent_ffn_reference(x.clone(), norm, 1e-6, w13, w2), norm, 1e-6, w13, w2)
    assert torch.allclose(twice, expected, rtol=1e-5, atol=1e-4)


def test_the_tiles_cover_each_product_once():
    # the kwarps rule: 128-column blocks, K split until each of two warps has >= 3 groups
    assert launch_config(24576, 32) == (192 * 4, 8)  # Qwen3-8B gate/up: 32 groups of K, 4 splits of 8
    assert launch_config(4096, 96) == (32 * 16, 6)  # down: 96 groups, 16 splits of 6
    tiles, per = launch_config(768, 2)
    assert tiles == 6 and per == 2


def test_the_grid_fits_the_device_at_once():
    # H100: 132 SMs, 64K registers, 2,048 threads, 228 KB of shared memory a SM
    assert programs_that_fit(125, 0, 2, 132) == 132 * 8  # 128 registers a thread: 4,096 a warp, 16 warps
    assert programs_that_fit(32, 0, 2, 132) == 132 * 32  # then 32 blocks a SM at most
    assert programs_that_fit(32, 0, 8, 132) == 132 * 8  # then 2,048 threads
    assert programs_that_fit(64, 60_000, 2, 132) == 132 * 3  # then shared memory (1 KB a block besides)
    assert programs_that_fit(255, 0, 8, 132) == 132  # never fewer than one a SM


def test_layouts_it_takes():
    gen = torch.Generator().manual_seed(0)
    w13, w2 = random_packed("tri", 768, 256, 128, generator=gen), random_packed("tri", 256, 384, 128, generator=gen)
    assert supported(w13, w2)
    assert not supported(random_packed("int4", 768, 256, 128, generator=gen), w2)
    assert not supported(w13, random_packed("bin", 256, 384, 128, generator=gen))
    assert not supported(w13, random_packed("tri", 256, 384, 64, generator=gen))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tri", "bin"])
def test_one_launch_with_grid_barriers_matches_the_phases(kind):
    x, norm, w13, w2 = _block(kind, 4096, 12288, seed=1)
    expected = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, FfnBuffers.make(4096, 12288, 128, DEVICE), phased=True)
    buffers = FfnBuffers.make(4096, 12288, 128, DEVICE)
    for programs in (None, 40):  # resident grid, and fewer programs than tiles (each walks several)
        got = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, buffers, phased=False, programs=programs)
        torch.cuda.synchronize()
        assert int(buffers.stuck) == 0
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3), (got - expected).abs().max()
        assert not buffers.gu.any()


def test_the_perf_script_checks_every_variant_in_miniature(tmp_path):
    """tests/perf/persistent_ffn.py --tiny: each variant it times is first checked against the four launches."""
    import json

    from tests.perf import persistent_ffn as script
    out = tmp_path / "ffn.json"
    assert script.main(["--tiny", "--sections", "check", "--kinds", "tri", "--json", str(out)]) == 0
    checks = json.loads(out.read_text())["checks"]
    assert len(checks) == 6 and all(c["ok"] for c in checks)
