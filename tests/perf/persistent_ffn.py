"""Issue 19, first stage: the whole one-row FFN in one persistent launch against today's four launches (H100/H200).

    python3 tests/perf/persistent_ffn.py --json $OUT/ffn.json [--shapes 8b,27b] [--kinds tri,bin]
    TRITON_INTERPRET=1 python3 tests/perf/persistent_ffn.py --tiny    # the code paths on a CPU (phased, no step)

check: at each shape and kind, the one-launch kernel (resident grid, and a grid smaller than the tiles) against
       the four-launch path's result (act_quant, the kwarps gate/up product, act_quant of the SwiGLU, the down
       product), the barrier's give-up flag, the gate/up sums left at zero.
ffn:   µs per FFN, CUDA-graph replays over enough copies of the layer's weights that each call reads HBM
       (tests/perf/gpu_kern.time_calls): four launches / one launch (resident grid) / one launch at 1, 2 programs
       a SM / 4 warps a program / phased (the same kernel once a phase: launches without barriers); the weights'
       GB/s against the copy bandwidth.
step:  the graphed one-row decode step (512 keys of a 640-key cache) of dummy models with and without the
       one-launch FFN, interleaved over --rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.kernels import interpreting  # noqa: E402
from quant.kernels.act_quant import quantize_activations  # noqa: E402
from quant.kernels.gemv_parts import _dot4  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv  # noqa: E402
from quant.kernels.persistent_ffn import _RESIDENT, FfnBuffers, persistent_ffn  # noqa: E402
from quant.packed_layout import PackedWeight, layout_kind, random_packed  # noqa: E402
from tests.perf.gpu_kern import (ROTATE_BYTES, Run, relative_error, replay_us, section_copy, step_model,  # noqa: E402
                                 time_calls)

SHAPES = {"8b": (4096, 12288), "27b": (5120, 17408)}
TINY = {"8b": (256, 384)}


@triton.jit
def _stream_gemv_kernel(w_ptr, s_ptr, xq_ptr, sx_ptr, sumx_ptr, out_ptr, N, NG, per_prog, total,
                        BITS: tl.constexpr, MULT: tl.constexpr, OFFSET: tl.constexpr, BYTE_MASK: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, WK: tl.constexpr, STAGES: tl.constexpr,
                        USE_ASM: tl.constexpr):
    """Probe: few long-lived programs streaming one product. The (column block, step of WK groups) iterations in
    one flat range, each program a contiguous share, the loads left to Triton's software pipeliner (STAGES deep,
    cp.async into shared memory) instead of registers; a column block's sums flushed with atomics when it ends."""
    STEPS: tl.constexpr = 8 // BITS
    GW: tl.constexpr = GROUP * BITS // 32
    spt = tl.cdiv(NG, WK)  # steps a column block
    start = tl.program_id(0) * per_prog
    end = tl.minimum(start + per_prog, total)
    gi = tl.arange(0, WK)
    rows = tl.arange(0, GW)
    word_rows = (gi[:, None] * GW + rows[None, :])[:, :, None]  # [WK, GW, 1]
    acc = tl.zeros([WK, BLOCK_N], dtype=tl.float32)
    for it in tl.range(start, end, num_stages=STAGES):
        cb = it // spt
        g0 = (it % spt) * WK
        offs_n = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        g = g0 + gi
        ok = g < NG
        w = tl.load(w_ptr + (g0 * GW + word_rows) * N + offs_n[None, None, :],
                    mask=n_mask[None, None, :] & ok[:, None, None], other=0)  # [WK, GW, BN]
        isum = tl.zeros([WK, GW, BLOCK_N], dtype=tl.int32)
        for j in tl.static_range(STEPS):
            codes = (w >> (BITS * j)) & BYTE_MASK
            xw = tl.load(xq_ptr + g[:, None] * (GROUP // 4) + STEPS * rows[None, :] + j, mask=ok[:, None], other=0)
            isum = _dot4(codes, tl.broadcast_to(xw[:, :, None], [WK, GW, BLOCK_N]), isum, USE_ASM)
        sumx = tl.load(sumx_ptr + g, mask=ok, other=0)
        sx = tl.load(sx_ptr + g, mask=ok, other=0.0)
        sw = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok[:, None] & n_mask[None, :], other=0.0)
        acc += (tl.sum(isum, axis=1) * MULT - OFFSET * sumx[:, None]).to(tl.float32) * sx[:, None] * sw.to(tl.float32)
        if (g0 + WK >= NG) | (it == end - 1):  # the block's last step, or the program's
            tl.atomic_add(out_ptr + offs_n, tl.sum(acc, axis=0), mask=n_mask)
            acc = tl.zeros([WK, BLOCK_N], dtype=tl.float32)


def stream_gemv(xq, sx, sumx, pw: PackedWeight, out: torch.Tensor, programs: int, stages: int, warps: int = 2):
    kind = layout_kind(pw.kind)
    ng = pw.in_features // pw.group_size
    total = triton.cdiv(pw.out_features, 128) * triton.cdiv(ng, warps)
    per = triton.cdiv(total, programs)
    _stream_gemv_kernel[(triton.cdiv(total, per),)](
        pw.words, pw.scales, xq.view(torch.int32), sx, sumx, out, pw.out_features, ng, per, total, BITS=kind.bits,
        MULT=kind.mult, OFFSET=kind.offset, BYTE_MASK={1: 0x01010101, 2: 0x03030303}[kind.bits], GROUP=pw.group_size,
        BLOCK_N=128, WK=warps, STAGES=stages, USE_ASM=not interpreting(), num_warps=warps)
    return out


def four_launches(x, norm, w13: PackedWeight, w2: PackedWeight, gu: torch.Tensor) -> torch.Tensor:
    """Today's path (engine.runtime.decode_step._feed_forward for one packed row)."""
    xq = quantize_activations(x, w13.group_size, norm, 1e-6)
    packed_gemv(*xq, w13, out=gu, accumulate=True)
    hq = quantize_activations(gu, w2.group_size, gated=True, zero_input=True)
    packed_gemv(*hq, w2, out=x, accumulate=True)
    return x


def layer(run: Run, kind: str, hidden: int, inter: int, seed: int):
    gen = torch.Generator(run.dev).manual_seed(seed)
    w13 = random_packed(kind, 2 * inter, hidden, 128, device=run.dev, generator=gen)
    w2 = random_packed(kind, hidden, inter, 128, device=run.dev, generator=gen)
    for w in (w13, w2):
        w.scales.uniform_(0.002, 0.004, generator=gen)  # keeps the repeated residual updates finite
    return w13, w2


def section_check(run: Run) -> None:
    for kind in run.args.kinds.split(","):
        for i, (shape, (hidden, inter)) in enumerate(run.shapes.items()):
            w13, w2 = layer(run, kind, hidden, inter, seed=i)
            x = torch.randn(1, hidden, device=run.dev)
            norm = 1 + 0.1 * torch.randn(hidden, device=run.dev)
            want = four_launches(x.clone(), norm, w13, w2, torch.zeros(1, 2 * inter, device=run.dev))
            for label, kw in (("resident grid", {}), ("40 programs", {"programs": 40}),
                              ("phased", {"phased": True}), ("4 warps", {"warps": 4})):
                buffers = FfnBuffers.make(hidden, inter, 128, run.dev)
                got = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, buffers, **kw)
                got = persistent_ffn(x.clone(), norm, 1e-6, w13, w2, buffers, **kw)  # the buffers' second use
                err = relative_error(got - x, want - x)
                ok = err < 2e-3 and int(buffers.stuck) == 0 and not buffers.gu.any()
                name = f"{kind} {shape} {label}"
                run.results["checks"].append({"name": name, "ok": ok, "max_rel_err": err,
                                              "stuck": int(buffers.stuck)})
                print(f"[{'ok' if ok else 'FAIL'}] {name}: rel err of the update {err:.1e}, stuck "
                      f"{int(buffers.stuck)}", flush=True)
            xq = quantize_activations(x, 128)
            want = packed_gemv(*xq, w13)
            for programs, stages in ((3, 2), (264, 3)):
                got = stream_gemv(*xq, w13, torch.zeros_like(want), programs, stages)
                err = relative_error(got, want)
                name = f"{kind} {shape} stream gate/up {programs}x{stages}"
                run.results["checks"].append({"name": name, "ok": err < 1e-5, "max_rel_err": err})
                print(f"[{'ok' if err < 1e-5 else 'FAIL'}] {name}: max rel err {err:.1e}", flush=True)
    run.results["resident"] = {str(k): v for k, v in _RESIDENT.items()}
    print(f"resident programs (device, kind, group, warps): {run.results['resident']}", flush=True)


def section_ffn(run: Run) -> None:
    copy = run.results["copy_gb_per_s"] or 1.0
    res = run.results.setdefault("ffn", [])
    for kind in run.args.kinds.split(","):
        for i, (shape, (hidden, inter)) in enumerate(run.shapes.items()):
            if run.out_of_time(f"ffn {kind} {shape}"):
                return
            w13, w2 = layer(run, kind, hidden, inter, seed=10 + i)
            nbytes = w13.nbytes + w2.nbytes
            copies = max(2, -(-(1 if run.args.tiny else ROTATE_BYTES) // nbytes))
            layers = [(w13, w2)] + [layer(run, kind, hidden, inter, seed=100 + c) for c in range(copies - 1)]
            x = torch.randn(1, hidden, device=run.dev)
            norm = torch.ones(hidden, device=run.dev)
            gu = torch.zeros(1, 2 * inter, device=run.dev)
            buffers = FfnBuffers.make(hidden, inter, 128, run.dev)
            sms = torch.cuda.get_device_properties(run.dev).multi_processor_count if run.dev.type == "cuda" else 2
            xq1 = quantize_activations(x, 128)
            xq2 = quantize_activations(torch.randn(1, inter, device=run.dev), 128)
            variants = {"four launches": (lambda a, b: four_launches(x, norm, a, b, gu), nbytes),
                        "one launch": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers), nbytes),
                        "one launch .cg": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers, act_cache=".cg"),
                                           nbytes),
                        "one launch, 4 warps": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers, warps=4),
                                                nbytes),
                        "phased": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers, phased=True), nbytes),
                        "gate/up kwarps": (lambda a, b: packed_gemv(*xq1, a, out=gu, accumulate=True), w13.nbytes),
                        "gate/up phase": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers, phased=True,
                                                                      phases=(1,)), w13.nbytes),
                        "down kwarps": (lambda a, b: packed_gemv(*xq2, b, out=x, accumulate=True), w2.nbytes),
                        **{f"gate/up stream {p}x{st}": (
                            lambda a, b, p=p, st=st: stream_gemv(*xq1, a, gu, sms * p, st), w13.nbytes)
                           for p, st in ((1, 3), (2, 3), (4, 2), (4, 4), (8, 2))},
                        "down phase": (lambda a, b: persistent_ffn(x, norm, 1e-6, a, b, buffers, phased=True,
                                                                   phases=(3,)), w2.nbytes)}
            row = {"kind": kind, "shape": shape, "bytes": nbytes, "copies": copies}
            for name, (fn, size) in variants.items():
                x.normal_()
                t = time_calls(run, [lambda a=a, b=b, fn=fn: fn(a, b) for a, b in layers])
                row[name] = {**t, "gb_per_s": size / (t["us"] * 1e-6) / 1e9}
            buffers.gu.zero_()
            row["stuck"] = int(buffers.stuck)
            res.append(row)
            base = row["four launches"]["us"]
            print(f"ffn {kind} {shape} ({nbytes / 1e6:.1f} MB, {copies} copies, copy {copy:.0f} GB/s): " + "; ".join(
                f"{n} {row[n]['us']:.2f} us ({base / row[n]['us']:.3f}x, {row[n]['gb_per_s'] / copy:.0%} of copy)"
                for n in variants) + f"; stuck {row['stuck']}", flush=True)
            del layers


def section_step(run: Run) -> None:
    from engine.runtime.cuda_graphs import DecodeStepRunner
    if run.dev.type != "cuda" or not run.args.steps:
        return
    res = run.results.setdefault("step", [])
    for spec in run.args.steps.split(","):
        if run.out_of_time(f"step {spec}"):
            return
        loaded, cache = step_model(spec, run.dev)
        times: dict[str, list[float]] = {"four launches": [], "one launch": []}
        logits, first = {}, {}
        for _ in range(run.args.rounds):
            for policy in times:
                step = DecodeStepRunner(loaded.model, cache, 1, 4, persistent_ffn=policy == "one launch")
                logits[policy] = step.run([1], [512], [0]).clone()
                first.setdefault(policy, logits[policy])
                times[policy].append(replay_us(step.graph))
                if step.workspace.ffn is not None and int(step.workspace.ffn.stuck):
                    run.results["checks"].append({"name": f"step {spec} stuck", "ok": False})
                del step
        err = relative_error(logits["one launch"], logits["four launches"])
        noise = relative_error(logits["four launches"], first["four launches"])  # atomics' order, run to run
        same_top = bool(logits["one launch"].argmax() == logits["four launches"].argmax())
        run.results["checks"].append({"name": f"step {spec} logits", "ok": same_top and err < max(1e-2, 10 * noise),
                                      "max_rel_err": err, "same_top": same_top})
        row = {"model": spec, "logits_rel_err": err, "four_launches_run_to_run": noise, "same_top": same_top,
               **{p: {"us": statistics.mean(t), "spread": (max(t) - min(t)) / 2, "samples": t}
                  for p, t in times.items()}}
        res.append(row)
        base = row["four launches"]["us"]
        print(f"step {spec}: " + ", ".join(f"{p} {row[p]['us']:.1f} ± {row[p]['spread']:.1f} us "
                                           f"({base / row[p]['us']:.3f}x)" for p in times)
              + f"; logits rel err {err:.1e} (four launches run to run {noise:.1e}), same top {same_top}", flush=True)
        del loaded, cache
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--kinds", default="tri,bin")
    parser.add_argument("--shapes", default="8b,27b")
    parser.add_argument("--steps", default="qwen3-8b:tri:int4,qwen3-8b:bin:int4,dense-27b:tri:int4")
    parser.add_argument("--sections", default="check,ffn,step")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.reps, args.warmup, args.steps = 1, 0, ""
    run = Run(args)
    run.shapes = TINY if args.tiny else {s: SHAPES[s] for s in args.shapes.split(",")}
    run.section("copy", section_copy)
    for name, fn in (("check", section_check), ("ffn", section_ffn), ("step", section_step)):
        if name in args.sections.split(","):
            run.section(name, fn)
    return run.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())
