"""One-row ternary GEMV variants against the engine's kernel (issue 19): scales and activations loaded ahead,
fewer split-K atomics, activation words laid out for vector loads, several warps splitting K inside a program.

    python3 tests/perf/gemv_variants.py --json $OUT/variants.json [--reps 20]
    TRITON_INTERPRET=1 python3 tests/perf/gemv_variants.py --tiny      # the code paths, on a CPU
    --sections variants,engine (engine: packed_gemv's "2d" against its "kwarps" path, tri and bin)

tests/perf/gemv_probe.py (H100, 2026-12-05) put the 8B ternary layer's four GEMVs at 29.8 µs against 18.1 µs for the
same tiles loaded without compute, and split-K atomics at 0.5-2.6 µs a matrix (product vs stores apart). Each
variant here is checked against the exact reference before it is timed (graph replays on rotated weight copies).
  base        packed_gemv as the engine runs it;
  xp          the group's activation words read as [step, word row] (contiguous per step: vector loads);
  pre sS      the group scales loaded with the words (two groups ahead), activations one group ahead;
  pre xp sS   both;
  w2/w4 sS    2 or 4 warps a program, each warp its own groups (a [W, 8, 128] tile), one atomic per column a program.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.kernels import interpreting, pdl_options  # noqa: E402
from quant.kernels.gemv_parts import _dot4, _program_tile  # noqa: E402
from quant.kernels.packed_gemv import gemv_launch_config, packed_gemv, packed_gemv_reference  # noqa: E402
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait  # noqa: E402
from quant.packed_layout import PackedWeight  # noqa: E402
from tests.perf.gpu_kern import SHAPES, Run, rotated, section_copy, time_calls  # noqa: E402

GW = 8  # word rows of a 2-bit group of 128


@triton.jit
def _load_group(w_ptr, g, g_end, rows, offs_n, n_mask, N):
    return tl.load(w_ptr + (g * 8 + rows)[:, None] * N + offs_n[None, :],
                   mask=n_mask[None, :] & ((rows * 0 + g) < g_end)[:, None], other=0,
                   eviction_policy="evict_first")  # [8, BN]


@triton.jit
def _tri_group(w, x_ptr, g, rows, XPERM: tl.constexpr, USE_ASM: tl.constexpr):
    """Σ_k u[k, n]·x[k] over group g: int32 [BN] (x words [g, row, step], or [g, step, row] with XPERM)."""
    isum = tl.zeros(w.shape, dtype=tl.int32)
    for j in tl.static_range(4):
        codes = (w >> (2 * j)) & 0x03030303
        if XPERM:
            xw = tl.load(x_ptr + g * 32 + 8 * j + rows)  # [8] contiguous
        else:
            xw = tl.load(x_ptr + g * 32 + 4 * rows + j)  # [8]
        isum = _dot4(codes, tl.broadcast_to(xw[:, None], w.shape), isum, USE_ASM)
    return tl.sum(isum, axis=0)


@triton.jit
def _load_x(x_ptr, sx_ptr, sumx_ptr, g, g_end, rows, XPERM: tl.constexpr):
    """Group g's activation words for each of the four steps ([8] each), its scale and code sum."""
    ok = (rows * 0 + g) < g_end
    if XPERM:
        x0 = tl.load(x_ptr + g * 32 + rows, mask=ok, other=0)
        x1 = tl.load(x_ptr + g * 32 + 8 + rows, mask=ok, other=0)
        x2 = tl.load(x_ptr + g * 32 + 16 + rows, mask=ok, other=0)
        x3 = tl.load(x_ptr + g * 32 + 24 + rows, mask=ok, other=0)
    else:
        x0 = tl.load(x_ptr + g * 32 + 4 * rows, mask=ok, other=0)
        x1 = tl.load(x_ptr + g * 32 + 4 * rows + 1, mask=ok, other=0)
        x2 = tl.load(x_ptr + g * 32 + 4 * rows + 2, mask=ok, other=0)
        x3 = tl.load(x_ptr + g * 32 + 4 * rows + 3, mask=ok, other=0)
    gs = tl.minimum(g, g_end - 1)
    return x0, x1, x2, x3, tl.load(sx_ptr + gs), tl.load(sumx_ptr + gs)


@triton.jit
def _dot_words(w, x0, x1, x2, x3, USE_ASM: tl.constexpr):
    """Σ over a group's words [8, BN] against its activation words (one [8] per shift step): int32 [BN]."""
    isum = _dot4(w & 0x03030303, tl.broadcast_to(x0[:, None], w.shape), tl.zeros(w.shape, dtype=tl.int32), USE_ASM)
    isum = _dot4((w >> 2) & 0x03030303, tl.broadcast_to(x1[:, None], w.shape), isum, USE_ASM)
    isum = _dot4((w >> 4) & 0x03030303, tl.broadcast_to(x2[:, None], w.shape), isum, USE_ASM)
    isum = _dot4((w >> 6) & 0x03030303, tl.broadcast_to(x3[:, None], w.shape), isum, USE_ASM)
    return tl.sum(isum, axis=0)


@triton.jit
def _variant_kernel(x_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, N, NG, groups_per_split, DEPTH: tl.constexpr,
                    XPERM: tl.constexpr, PRE: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """One warp, 128 columns, DEPTH (2 or 4) groups in flight; partial sums added with atomics. PRE: the
    group scales travel with the words (two groups ahead), the activations one group ahead."""
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(1, N, 1, 128)
    rows = tl.arange(0, 8)
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    w0 = _load_group(w_ptr, g_start, g_end, rows, offs_n, n_mask, N)
    w1 = _load_group(w_ptr, g_start + 1, g_end, rows, offs_n, n_mask, N)
    s0 = tl.load(s_ptr + g_start * N + offs_n, mask=n_mask, other=0.0)
    s1 = tl.load(s_ptr + tl.minimum(g_start + 1, g_end - 1) * N + offs_n, mask=n_mask, other=0.0)
    if DEPTH == 4:
        w2 = _load_group(w_ptr, g_start + 2, g_end, rows, offs_n, n_mask, N)
        w3 = _load_group(w_ptr, g_start + 3, g_end, rows, offs_n, n_mask, N)
    else:
        w2 = w0
        w3 = w0
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([128], dtype=tl.float32)
    if PRE:
        x0, x1, x2, x3, sx_n, sumx_n = _load_x(x_ptr, sx_ptr, sumx_ptr, g_start, g_end, rows, XPERM)
        for g in range(g_start, g_end):
            w = w0
            w0 = w1
            w1 = _load_group(w_ptr, g + 2, g_end, rows, offs_n, n_mask, N)
            sw = s0.to(tl.float32)
            s0 = s1
            s1 = tl.load(s_ptr + tl.minimum(g + 2, g_end - 1) * N + offs_n, mask=n_mask, other=0.0)
            c0, c1, c2, c3, sx, sumx = x0, x1, x2, x3, sx_n, sumx_n
            x0, x1, x2, x3, sx_n, sumx_n = _load_x(x_ptr, sx_ptr, sumx_ptr, g + 1, g_end, rows, XPERM)
            dot = _dot_words(w, c0, c1, c2, c3, USE_ASM)  # [BN]
            acc += (dot - sumx).to(tl.float32) * sx * sw
    else:
        for g in range(g_start, g_end):
            w = w0
            if DEPTH == 4:
                w0 = w1
                w1 = w2
                w2 = w3
                w3 = _load_group(w_ptr, g + 4, g_end, rows, offs_n, n_mask, N)
            else:
                w0 = w1
                w1 = _load_group(w_ptr, g + 2, g_end, rows, offs_n, n_mask, N)
            dot = _tri_group(w, x_ptr, g, rows, XPERM, USE_ASM)  # [BN]
            sumx = tl.load(sumx_ptr + g)
            sx = tl.load(sx_ptr + g)
            sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
            acc += (dot - sumx).to(tl.float32) * sx * sw
    tl.atomic_add(out_ptr + offs_n, acc, mask=n_mask)


@triton.jit
def _warps_kernel(x_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, N, NG, groups_per_split, WK: tl.constexpr,
                  USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """WK warps, 128 columns; each step loads WK groups as a [WK, 8, BN] tile (next step's in flight), sums over
    the groups once at the end: one atomic per column a program."""
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(1, N, 1, 128)
    gi = tl.arange(0, WK)
    rows = tl.arange(0, 8)
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    word_rows = (gi[:, None] * 8 + rows[None, :])[:, :, None]  # [WK, 8, 1]
    cols = offs_n[None, None, :]
    full = n_mask[None, None, :] & (word_rows >= 0)
    w_next = tl.load(w_ptr + (g_start * 8 + word_rows) * N + cols,
                     mask=full & ((g_start + gi)[:, None, None] < g_end), other=0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([WK, 128], dtype=tl.float32)
    for g0 in range(g_start, g_end, WK):
        w = w_next
        w_next = tl.load(w_ptr + ((g0 + WK) * 8 + word_rows) * N + cols,
                         mask=full & ((g0 + WK + gi)[:, None, None] < g_end), other=0, eviction_policy="evict_first")
        g = g0 + gi  # [WK]
        ok = g < g_end
        isum = tl.zeros([WK, 8, 128], dtype=tl.int32)
        for j in tl.static_range(4):
            codes = (w >> (2 * j)) & 0x03030303
            xw = tl.load(x_ptr + g[:, None] * 32 + 4 * rows[None, :] + j, mask=ok[:, None], other=0)  # [WK, 8]
            isum = _dot4(codes, tl.broadcast_to(xw[:, :, None], [WK, 8, 128]), isum, USE_ASM)
        dot = tl.sum(isum, axis=1)  # [WK, BN]
        sumx = tl.load(sumx_ptr + g, mask=ok, other=0)
        sx = tl.load(sx_ptr + g, mask=ok, other=0.0)
        sw = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok[:, None] & n_mask[None, :],
                     other=0.0).to(tl.float32)  # [WK, BN]
        acc += (dot - sumx[:, None]).to(tl.float32) * sx[:, None] * sw
    tl.atomic_add(out_ptr + offs_n, tl.sum(acc, axis=0), mask=n_mask)


def permuted(xq) -> torch.Tensor:
    """The activation words of each group as [step, word row] (int32 [NG·32])."""
    words = xq[0].view(torch.int32).view(-1, GW, 4)  # [NG, row, step]
    return words.transpose(1, 2).contiguous().view(-1)


def run_variant(xq, xp, pw: PackedWeight, out: torch.Tensor, kind: str, split: int, depth: int = 2,
                warps: int = 1, pre: bool = False) -> torch.Tensor:
    ng = pw.in_features // 128
    per = triton.cdiv(ng, split)
    if warps > 1:
        per = triton.cdiv(per, warps) * warps
    grid = (triton.cdiv(pw.out_features, 128), triton.cdiv(ng, per))
    common = dict(USE_ASM=not interpreting(), **pdl_options(out.device))
    if warps > 1:
        _warps_kernel[grid](xq[0].view(torch.int32), xq[1], xq[2], pw.words, pw.scales, out, pw.out_features, ng, per,
                            WK=warps, num_warps=warps, **common)
    else:
        x = xp if kind == "xp" else xq[0].view(torch.int32)
        _variant_kernel[grid](x, xq[1], xq[2], pw.words, pw.scales, out, pw.out_features, ng, per, DEPTH=depth,
                              XPERM=kind == "xp", PRE=pre, num_warps=1, **common)
    return out


def variants(rule: int, ng: int) -> list[tuple[str, dict]]:
    splits = sorted({s for s in (2, 4, 8, 16, 32, rule) if 2 * s <= ng})
    near = [s for s in splits if s in (rule // 2, rule)]
    out = [("xp", dict(kind="xp", split=rule))]
    out += [(f"pre s{s}", dict(kind="x", split=s, pre=True)) for s in splits if s >= rule // 4]
    out += [(f"pre xp s{s}", dict(kind="xp", split=s, pre=True)) for s in near]
    out += [(f"w2 s{s}", dict(kind="x", split=s, warps=2)) for s in near if 4 * s <= ng]
    return out


def section_variants(run: Run) -> None:
    for i, (shape, _) in enumerate(run.shapes.items()):
        if run.out_of_time(f"variants {shape}"):
            return
        pw = run.weights("tri", shape, seed=i)
        xq = run.activations(1, pw.in_features, seed=i)
        xp = permuted(xq)
        n, ng = pw.out_features, pw.in_features // 128
        rule = gemv_launch_config(n, ng, "tri")[1]
        want = packed_gemv_reference(*xq, pw)
        mats, out = rotated(run, pw), torch.zeros(1, n, device=run.dev)
        row = {"shape": shape, "bytes": pw.nbytes, "rule": rule}
        row["base"] = time_calls(run, [lambda w=w: packed_gemv(*xq, w, out=out, accumulate=True) for w in mats])["us"]
        for name, kw in variants(rule, ng):
            got = run_variant(xq, xp, pw, torch.zeros(1, n, device=run.dev), **kw)
            err = ((got - want).abs().max() / want.abs().max()).item()
            run.results["checks"].append({"name": f"{shape} {name}", "ok": err < 1e-5, "detail": f"{err:.1e}"})
            if err >= 1e-5:
                print(f"[FAIL] {shape} {name}: max rel err {err:.1e}", flush=True)
                continue
            row[name] = time_calls(run, [lambda w=w, kw=kw: run_variant(xq, xp, w, out, **kw) for w in mats])["us"]
        run.results["variants"].append(row)
        best = min((k for k in row if isinstance(row[k], float)), key=row.get)
        print(f"{shape}: {pw.nbytes / 1e6:.1f} MB base {row['base']:.2f} best {best} {row[best]:.2f} | "
              + " ".join(f"{k}:{v:.2f}" for k, v in row.items() if isinstance(v, float)), flush=True)


def section_engine(run: Run) -> None:
    """packed_gemv's one-row paths as the engine launches them: "2d" (the one-warp kernel at its split rule) and
    "kwarps" (its launch rule), tri and bin, at the layer shapes and the Qwen3.6 DeltaNet q/k/v/z (16384×5120)."""
    from quant.kernels.packed_gemv import default_variant, kwarps_launch_config
    shapes = dict(run.shapes, **({} if run.args.tiny else {"27b deltanet qkvz": (16384, 5120)}))
    for kind in ("tri", "bin"):
        for i, (shape, (n, k)) in enumerate(shapes.items()):
            if run.out_of_time(f"engine {kind} {shape}"):
                return
            run.shapes[shape] = (n, k)
            pw = run.weights(kind, shape, seed=i)
            xq = run.activations(1, k, seed=i)
            want = packed_gemv_reference(*xq, pw)
            config = kwarps_launch_config(n, k // 128)
            got = packed_gemv(*xq, pw, config=config, variant="kwarps")
            err = ((got - want).abs().max() / want.abs().max()).item()
            run.results["checks"].append({"name": f"kwarps {kind} {shape}", "ok": err < 1e-5, "detail": f"{err:.1e}"})
            mats, out = rotated(run, pw), torch.zeros(1, n, device=run.dev)
            row = {"kind": kind, "shape": shape, "default": default_variant(kind, 128, 1, k, n), "split": config[1]}
            for variant in ("2d", "kwarps"):
                cfg = config if variant == "kwarps" else None
                row[variant] = time_calls(run, [lambda w=w, v=variant, c=cfg: packed_gemv(
                    *xq, w, out=out, accumulate=True, config=c, variant=v) for w in mats])["us"]
            run.results["engine"].append(row)
            print(f"engine {kind} {shape}: default {row['default']}; 2d {row['2d']:.2f} us, kwarps s{config[1]} "
                  f"{row['kwarps']:.2f} us ({row['kwarps'] / row['2d']:.2f}x); err {err:.1e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sections", default="variants,engine")
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.warmup = 1, 0
    run = Run(args)
    run.shapes = ({"8b qkv": (96, 1024), "8b down": (64, 2048)} if args.tiny
                  else {k: v for k, v in SHAPES.items() if "21504" not in k})
    run.results.update({"variants": [], "engine": []})
    run.section("copy", section_copy)
    for name, fn in (("variants", section_variants), ("engine", section_engine)):
        if name in args.sections.split(","):
            run.section(name, fn)
    return run.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
