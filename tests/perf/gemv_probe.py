"""Where a batch-1 ternary GEMV's time goes (issue 19): phases left out, launch shapes, and the read floor.

    python3 tests/perf/gemv_probe.py --json $OUT/probe.json [--sections shapes,chain] [--reps 30]
    TRITON_INTERPRET=1 python3 tests/perf/gemv_probe.py --tiny --json /tmp/probe.json   # the code paths, on a CPU

Timed as tests/perf/gpu_kern.py times (CUDA-graph replays of consecutive calls on rotated copies, so weights come
from HBM; PDL as in the decode step). Every variant is first checked against the exact reference, or (the ones
that leave a phase out) against what it must compute instead.
  shapes: at the Qwen3-8B and 27B-class projections, 2-bit `tri` g128, one row:
      product    packed_gemv as the engine runs it (its split-K launch rule);
      split S    the same kernel with S splits of K (fewer, longer programs, or more, shorter ones);
      no-atomic  each split stores its partial sums apart (no atomics: the tail's cost);
      load-only  the words are read and XOR-folded, no dp4a or scaling (the ALU's cost);
      read       a streaming read of the same bytes by a few programs per SM (the floor of one kernel);
  chain: a decode step's GEMVs alone, the 8B shape's 36 layers x (qkv, o, gate/up, down) in one graph:
      product kernels (as launched, and with the split rule of ~1024 programs), then the read kernel per matrix
      (144 kernels), then the read kernel per layer (36): what kernel boundaries cost on their own;
  splits: every layout's one-row GEMV at every split of K (tri, bin, int4, int8 through packed_gemv, tri5 through
      its own kernel) at the 8B and 27B-class shapes: the best split against the launch rule's.
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
from quant.kernels.gemv_parts import _program_tile, split_k  # noqa: E402
from quant.kernels.packed_gemv import _group_dot, gemv_launch_config, packed_gemv  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv_reference  # noqa: E402
from quant.kernels.pdl import gdc_launch_dependents, gdc_wait  # noqa: E402
from quant.packed_layout import PackedWeight  # noqa: E402
from tests.perf.gpu_kern import SHAPES, TINY_SHAPES, Run, rotated, section_copy, time_calls  # noqa: E402

SECTIONS = ("copy", "shapes", "chain", "splits")
SPLIT_KINDS = ("tri", "bin", "int4", "int8", "tri5")
LAYER = ("8b qkv", "8b o", "8b gate_up", "8b down")
READ_BLOCK = 4096  # int32 words a read program loads per iteration (16 KB: 32 words a thread, 4 warps)


@triton.jit
def _probe_gemv_kernel(xq_ptr, sx_ptr, sumx_ptr, w_ptr, s_ptr, out_ptr, N, K, NG, groups_per_split,
                       MODE: tl.constexpr, USE_ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """packed_gemv's one-row 2-bit kernel (g128, 128 columns a warp, two groups in flight), MODE 0: as it is;
    1: partial sums stored at [split, N] (no atomics); 2: load-only (words XOR-folded, stored at [split, N])."""
    GW: tl.constexpr = 8
    pid_k = tl.program_id(1)
    offs_m, m_mask, offs_n, n_mask = _program_tile(1, N, 1, 128)
    rows = tl.arange(0, GW)
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, NG)
    w_next = tl.load(w_ptr + (g_start * GW + rows)[:, None] * N + offs_n[None, :],
                     mask=n_mask[None, :] & ((rows * 0 + g_start) < g_end)[:, None], other=0, eviction_policy="evict_first")
    w_after = tl.load(w_ptr + ((g_start + 1) * GW + rows)[:, None] * N + offs_n[None, :],
                      mask=n_mask[None, :] & ((rows * 0 + g_start + 1) < g_end)[:, None], other=0,
                      eviction_policy="evict_first")
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([1, 128], dtype=tl.float32)
    fold = tl.zeros([GW, 128], dtype=tl.int32)
    for g in range(g_start, g_end):
        w = w_next
        w_next = w_after
        w_after = tl.load(w_ptr + ((g + 2) * GW + rows)[:, None] * N + offs_n[None, :],
                          mask=n_mask[None, :] & ((rows * 0 + g + 2) < g_end)[:, None], other=0,
                          eviction_policy="evict_first")
        if MODE == 2:
            fold ^= w
        else:
            dot = _group_dot(w, xq_ptr, g, offs_m, m_mask, 1, rows, K // 4, 2, 0x03030303, 128, 1, 128, USE_ASM,
                             False)  # [1, BN]
            sumx = tl.load(sumx_ptr + offs_m * NG + g)
            sx = tl.load(sx_ptr + offs_m * NG + g)
            sw = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += (dot - sumx[:, None]).to(tl.float32) * sx[:, None] * sw[None, :]
    if MODE == 0:
        tl.atomic_add(out_ptr + offs_n[None, :], acc, mask=n_mask[None, :])
    elif MODE == 1:
        tl.store(out_ptr + pid_k * N + offs_n[None, :], acc, mask=n_mask[None, :])
    else:
        tl.store(out_ptr + pid_k * N + offs_n[None, :], tl.xor_sum(fold, 0)[None, :].to(tl.float32), mask=n_mask[None, :])


def probe_gemv(xq, pw: PackedWeight, out: torch.Tensor, split: int, mode: int) -> torch.Tensor:
    """MODE 0 adds into out [1, N]; 1 and 2 store into out [split, N]."""
    ng = pw.in_features // 128
    per_split = triton.cdiv(ng, split)
    grid = (triton.cdiv(pw.out_features, 128), triton.cdiv(ng, per_split))
    _probe_gemv_kernel[grid](xq[0].view(torch.int32), xq[1], xq[2], pw.words, pw.scales, out, pw.out_features,
                             pw.in_features, ng, per_split, MODE=mode, USE_ASM=not interpreting(), num_warps=1,
                             **pdl_options(out.device))
    return out


@triton.jit
def _read_kernel(ptr, out_ptr, n_words, words_per_program, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """XOR of a contiguous range of words (a streaming read: BLOCK words in flight per iteration)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    start = pid * words_per_program
    end = tl.minimum(start + words_per_program, n_words)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + idx, mask=idx < end, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def read_words(words: torch.Tensor, out: torch.Tensor, programs: int) -> torch.Tensor:
    """Read a flat int32 buffer with at most `programs` programs; out [programs] int32 (one XOR each)."""
    n = words.numel()
    per = triton.cdiv(triton.cdiv(n, programs), READ_BLOCK) * READ_BLOCK
    grid = (triton.cdiv(n, per),)
    _read_kernel[grid](words, out, n, per, BLOCK=READ_BLOCK, USE_PDL=out.is_cuda, num_warps=4)
    return out


def xor_all(t: torch.Tensor) -> torch.Tensor:
    """XOR over the first dimension of an int32 tensor [R, ...] (pairwise halving)."""
    while t.shape[0] > 1:
        half = t.shape[0] // 2
        t = torch.cat([t[:half] ^ t[half:2 * half], t[2 * half:]])
    return t[0]


def read_programs(run: Run) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count if run.dev.type == "cuda" else 2
    return 8 * sms


def _check(run: Run, name: str, ok: bool, detail: str) -> None:
    run.results["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def section_shapes(run: Run) -> None:
    for i, shape in enumerate(run.shapes):
        if run.out_of_time(f"shapes {shape}"):
            return
        pw = run.weights("tri", shape, seed=i)
        xq = run.activations(1, pw.in_features, seed=i)
        n, ng = pw.out_features, pw.in_features // 128
        _, default_split, _ = gemv_launch_config(n, ng, "tri")
        want = packed_gemv_reference(*xq, pw)
        got = probe_gemv(xq, pw, torch.zeros(1, n, device=run.dev), default_split, 0)
        err = ((got - want).abs().max() / want.abs().max()).item()
        _check(run, f"probe {shape}", err < 1e-5, f"max rel err {err:.1e}")
        part = probe_gemv(xq, pw, torch.zeros(default_split, n, device=run.dev), default_split, 1).sum(0)
        err = ((part - want[0]).abs().max() / want.abs().max()).item()
        _check(run, f"no-atomic {shape}", err < 1e-5, f"max rel err {err:.1e}")
        folded = probe_gemv(xq, pw, torch.zeros(1, n, device=run.dev), 1, 2)  # one split: the XOR of every word row
        fold = xor_all(pw.words)  # [N]
        _check(run, f"load-only {shape}", torch.equal(folded[0], fold.float()), "XOR of each column's words")
        out = torch.zeros(read_programs(run), dtype=torch.int32, device=run.dev)
        read_words(pw.words.view(-1), out, read_programs(run))
        _check(run, f"read {shape}", torch.equal(xor_all(out[:, None]), xor_all(fold[:, None])), "XOR of all the words")
        mats = rotated(run, pw)
        row = {"shape": shape, "bytes": pw.nbytes, "default_split": default_split}
        outs = {s: torch.zeros(max(s, 1), n, device=run.dev) for s in (1, 2, 4, 8, 16, 32, default_split)}
        row["product"] = time_calls(run, [lambda w=w: packed_gemv(*xq, w, out=outs[1], accumulate=True) for w in mats])
        for s in sorted({4, 8, 16, 32} | {default_split}):
            if s * 2 > ng:
                continue
            row[f"split {s}"] = time_calls(run, [lambda w=w, s=s: probe_gemv(xq, w, outs[1], s, 0) for w in mats])
        row["no-atomic"] = time_calls(run, [lambda w=w: probe_gemv(xq, w, outs[default_split], default_split, 1)
                                            for w in mats])
        row["load-only"] = time_calls(run, [lambda w=w: probe_gemv(xq, w, outs[default_split], default_split, 2)
                                            for w in mats])
        row["read"] = time_calls(run, [lambda w=w: read_words(w.words.view(-1), out, read_programs(run)) for w in mats])
        run.results["shapes"].append(row)
        copy = run.results.get("copy_gb_per_s") or float("nan")
        cells = "  ".join(f"{k} {v['us']:.2f}" for k, v in row.items() if isinstance(v, dict))
        print(f"{shape}: {pw.nbytes / 1e6:.1f} MB (copy BW: {pw.nbytes / copy / 1e3:.2f} us)  {cells}", flush=True)


def section_chain(run: Run) -> None:
    """36 layers of the 8B shape's four matrices, each layer in one buffer (the read-per-layer kernel's input)."""
    layers = 2 if run.args.tiny else 36
    shapes = [run.shapes[s] for s in LAYER if s in run.shapes]
    words_per = [(k // 16) * n for n, k in shapes]
    buffers, weights = [], []
    for layer in range(layers):
        buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (sum(words_per),), dtype=torch.int32, device=run.dev)
        mats, at = [], 0
        for (n, k), w in zip(shapes, words_per):
            scales = torch.full((k // 128, n), 0.01, dtype=torch.float16, device=run.dev)
            mats.append(PackedWeight("tri", buf[at:at + w].view(k // 16, n), scales, n, k, 128))
            at += w
        buffers.append(buf)
        weights.append(mats)
    xqs = [run.activations(1, k, seed=j) for j, (n, k) in enumerate(shapes)]
    outs = [torch.zeros(1, n, device=run.dev) for n, _ in shapes]
    out = torch.zeros(read_programs(run), dtype=torch.int32, device=run.dev)
    total_bytes = sum(m.nbytes for mats in weights for m in mats)
    result = {"layers": layers, "bytes": total_bytes}
    result["product"] = time_calls(run, [lambda mats=mats: [packed_gemv(*xq, m, out=o, accumulate=True)
                                                           for xq, m, o in zip(xqs, mats, outs)] for mats in weights])
    rule = [(128, split_k(triton.cdiv(n, 128), k // 128, 1024), 1) for n, k in shapes]
    result["product 1024"] = time_calls(run, [lambda mats=mats: [packed_gemv(*xq, m, out=o, accumulate=True, config=c)
                                                                for xq, m, o, c in zip(xqs, mats, outs, rule)]
                                              for mats in weights])
    result["read per matrix"] = time_calls(run, [lambda mats=mats: [read_words(m.words.view(-1), out, read_programs(run))
                                                                    for m in mats] for mats in weights])
    result["read per layer"] = time_calls(run, [lambda b=b: read_words(b, out, read_programs(run)) for b in buffers])
    run.results["chain"] = result
    copy = run.results.get("copy_gb_per_s") or float("nan")
    print(f"chain ({layers} layers, {total_bytes / 1e9:.2f} GB; at copy BW {total_bytes / copy / 1e3 / layers:.2f} us a "
          f"layer): " + "  ".join(f"{k} {v['us']:.2f} us a layer" for k, v in result.items() if isinstance(v, dict)),
          flush=True)


def section_splits(run: Run) -> None:
    """µs of each (kind, shape, split); the launch rule's split and the best one."""
    from quant.kernels.tri5_gemv import tri5_launch_config
    for kind in SPLIT_KINDS:
        for i, shape in enumerate(run.shapes):
            if run.out_of_time(f"splits {kind} {shape}"):
                return
            pw = run.weights(kind, shape, seed=i)
            xq = run.activations(1, pw.in_features, seed=i)
            n, steps = pw.out_features, pw.in_features // (256 if kind == "tri5" else 128)
            rule = (tri5_launch_config(n, steps) if kind == "tri5" else gemv_launch_config(n, steps, kind))[1]
            want = packed_gemv_reference(*xq, pw)
            mats, out = rotated(run, pw), torch.zeros(1, n, device=run.dev)
            row = {"kind": kind, "shape": shape, "rule": rule, "us": {}}
            s = 1
            while s <= 32 and (s == 1 or s * 2 <= steps // 2 or s == rule):
                got = packed_gemv(*xq, pw, config=(128, s, 1))
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err >= 1e-5:
                    _check(run, f"split {kind} {shape} {s}", False, f"max rel err {err:.1e}")
                row["us"][s] = time_calls(run, [lambda w=w, s=s: packed_gemv(*xq, w, out=out, accumulate=True,
                                                                              config=(128, s, 1)) for w in mats])["us"]
                s *= 2
            best = min(row["us"], key=row["us"].get)
            row["best"] = best
            run.results["splits"].append(row)
            print(f"splits {kind} {shape}: rule {rule} {row['us'][rule]:.2f} us, best {best} {row['us'][best]:.2f} us; "
                  + " ".join(f"{k}:{v:.2f}" for k, v in row["us"].items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if args.tiny:
        args.reps, args.warmup = 1, 0
    run = Run(args)
    run.shapes = TINY_SHAPES if args.tiny else {k: v for k, v in SHAPES.items() if "21504" not in k}
    if args.tiny:
        run.shapes = {"8b qkv": (96, 512), "8b o": (64, 512), "8b gate_up": (160, 512), "8b down": (64, 768)}
    run.results.update({"shapes": [], "chain": None, "splits": []})
    for name, fn in (("copy", section_copy), ("shapes", section_shapes), ("chain", section_chain),
                     ("splits", section_splits)):
        if name in args.sections:
            run.section(name, fn)
    return run.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
