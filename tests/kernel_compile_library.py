"""tests/kernel_compile's cases for the kernels no engine path launches yet (called directly: each is a launch
site the check would otherwise report as unreached): packed_gemm, the base-3 ternary kernels, the tensor-core
rows kernel. Built with zero / random inputs: nothing runs, only the launches' signatures matter."""
from __future__ import annotations

import torch


def library_cases():
    """Kernels that no engine path launches, kept for their tests and tests/perf/gpu_kernels.py: called directly
    (each is a launch site the check would otherwise report as unreached)."""
    from quant.kernels.packed_gemm import packed_gemm
    from quant.packed_layout import KINDS, random_packed
    for kind in KINDS:
        for dtype in (torch.bfloat16, torch.float16):
            pw = random_packed(kind, 128, 256, 64, generator=torch.Generator().manual_seed(0))
            yield f"library: packed_gemm {kind} {str(dtype)[6:]}", (
                lambda pw=pw, dtype=dtype: packed_gemm(torch.randn(32, 256, dtype=dtype), pw))
    yield from _kwarps_cases()
    yield from _persistent_ffn_cases()
    yield from _tri5_cases()
    yield from _mma_cases()
    yield from _deltanet_prefill_cases()


def _deltanet_prefill_cases():
    """The chunked gated delta rule for hybrid prefill (engine.kernels.deltanet_prefill) at the real models' head
    dims, with each activation dtype and the dot precision it takes (on the CPU the engine's cases run it with
    the same dtype rule, so these add the dtypes the tiny cases do not)."""
    from engine.kernels.deltanet_prefill import chunk_gated_delta_rule_triton
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q, k = torch.zeros(1, 70, 2, 128, dtype=dtype), torch.zeros(1, 70, 2, 128, dtype=dtype)
        v = torch.zeros(1, 70, 4, 128, dtype=dtype)
        g, beta = torch.zeros(1, 70, 4), torch.zeros(1, 70, 4)
        state = torch.zeros(1, 4, 128, 128)
        yield f"library: deltanet prefill {str(dtype)[6:]}", (
            lambda a=(q, k, v, g, beta, state): chunk_gated_delta_rule_triton(*a))


def _activations(rows: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 activations as quantize_activations returns them (values do not matter: nothing runs)."""
    return (torch.zeros(rows, k, dtype=torch.int8), torch.ones(rows, k // group),
            torch.zeros(rows, k // group, dtype=torch.int32))


def _kwarps_cases():
    """The one-row GEMV whose warps split K (the engine launches it for large ternary g128 matrices only, larger
    than the tiny engine cases): the 2-bit layouts, split-K or one split, added into the output or not."""
    from quant.kernels.packed_gemv import packed_gemv
    from quant.packed_layout import random_packed
    for i, kind in enumerate(("tri", "bin")):
        pw = random_packed(kind, 256, 1024, 128, generator=torch.Generator().manual_seed(0))
        for split in (1, 4):
            accumulate = (i + split) % 2 == 0
            yield f"library: kwarps {kind} split={split}{' accumulate' if accumulate else ''}", (
                lambda pw=pw, split=split, accumulate=accumulate: packed_gemv(
                    *_activations(1, 1024, 128), pw, out=torch.zeros(1, 256), accumulate=accumulate,
                    config=(128, split, 2), variant="kwarps"))


def _persistent_ffn_cases():
    """The one-launch FFN (quant.kernels.persistent_ffn; not in the engine's step yet): both ≤ 2-bit layouts, the
    persistent form with its grid barriers and the phased form (one launch a phase)."""
    from quant.kernels.persistent_ffn import FfnBuffers, persistent_ffn
    from quant.packed_layout import random_packed
    for kind in ("tri", "bin"):
        gen = torch.Generator().manual_seed(0)
        w13, w2 = random_packed(kind, 768, 256, 128, generator=gen), random_packed(kind, 256, 384, 128, generator=gen)
        for phased in (False, True):
            yield f"library: persistent ffn {kind}{' phased' if phased else ''}", (
                lambda w13=w13, w2=w2, phased=phased: persistent_ffn(
                    torch.zeros(1, 256), torch.ones(256), 1e-6, w13, w2, FfnBuffers.make(256, 384, 128, "cpu"),
                    phased=phased, programs=16))


def _tri5_cases():
    """The base-3 layout's kernels as the engine will launch them (not wired yet) and tests/perf/gpu_kern.py
    times them: the one-row GEMV and the row loop (every padded row count, with the warps its launch config
    gives) at each group size, split-K and one split, added into the output or not, and the prefill
    dequantizer in both activation dtypes."""
    from quant.kernels.packed_dequant import dequantize_t
    from quant.kernels.packed_gemv import packed_gemv
    from quant.kernels.tri5_gemv import tri5_launch_config
    from quant.packed_layout import random_packed
    for i, group in enumerate((64, 128, 256)):
        pw = random_packed("tri5", 256, 1024, group, generator=torch.Generator().manual_seed(0))
        for rows in (1, 2, 3, 8, 16):
            for split in (1, 4):
                accumulate = (i + rows + split) % 2 == 0
                yield f"library: tri5 gemv g{group} M={rows} split={split}{' accumulate' if accumulate else ''}", (
                    lambda pw=pw, rows=rows, split=split, accumulate=accumulate: packed_gemv(
                        *_activations(rows, 1024, pw.group_size), pw, out=torch.zeros(rows, 256),
                        accumulate=accumulate, config=(128, split, tri5_launch_config(256, 4, rows)[2])))
        for dtype in (torch.bfloat16, torch.float16):
            yield f"library: tri5 dequantize g{group} {str(dtype)[6:]}", (
                lambda pw=pw, dtype=dtype: dequantize_t(pw, dtype))


def _mma_cases():
    """The tensor-core kernel for 2..16 rows: every packed kind and group size it takes, both padded row
    counts (8, 16), its launch config's shape (128 columns, 4 warps: wgmma on sm_90) as tests/perf/gpu_kern.py
    times it and narrower/wider ones (2 warps: mma.sync; 8 warps), split-K and one split, added into the
    output or not."""
    from quant.kernels.packed_gemv import packed_gemv
    from quant.kernels.packed_mma import mma_supported
    from quant.packed_layout import KINDS, random_packed
    i = 0
    for kind in KINDS:
        for group in (32, 64, 128, 256):
            if not mma_supported(kind, group):
                continue
            pw = random_packed(kind, 256, 1024, group, generator=torch.Generator().manual_seed(0))
            for rows, config in ((2, (128, 4, 4, 3)), (16, (128, 1, 4, 3)), (5, (64, 2, 2, 3)), (12, (256, 2, 8, 3))):
                accumulate = i % 3 == 0
                i += 1
                yield f"library: mma {kind} g{group} M={rows} {config}{' accumulate' if accumulate else ''}", (
                    lambda pw=pw, rows=rows, config=config, accumulate=accumulate: packed_gemv(
                        *_activations(rows, 1024, pw.group_size), pw, out=torch.zeros(rows, 256),
                        accumulate=accumulate, config=config, variant="mma"))
    yield from _mma_load_cases()


def _mma_load_cases():
    """The tensor-core kernel's ways of loading a tile as tests/perf/gpu_issue20.py sweeps them: activations a tile
    ahead or all planes' together, packed bytes by word rows or not; tri and int4 (one group a tile), bin (two)."""
    from quant.kernels.packed_mma import packed_mma
    from quant.packed_layout import random_packed
    for kind, group in (("tri", 128), ("int4", 128), ("bin", 64)):
        pw = random_packed(kind, 256, 1024, group, generator=torch.Generator().manual_seed(0))
        for rows, config, x_ahead, word_rows in ((8, (128, 2, 4, 2), 2, False), (16, (256, 1, 8, 1), 2, True),
                                                 (8, (128, 2, 4, 2), 1, True), (16, (64, 2, 2, 3), 0, True)):
            yield (f"library: mma {kind} g{group} M={rows} {config} x ahead {x_ahead}"
                   f"{' word rows' if word_rows else ''}"), (
                lambda pw=pw, rows=rows, config=config, x_ahead=x_ahead, word_rows=word_rows:
                packed_mma(*_activations(rows, 1024, pw.group_size), pw, torch.zeros(rows, 256), True, config,
                           x_ahead=x_ahead, word_rows=word_rows))
