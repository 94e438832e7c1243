"""One CPU int4 matrix, M rows: torch's int4 kernel against the decode-to-bfloat16 + GEMM path
(engine.runtime.cpu_int4_prefill), per shape and row count; the break-even row count; and the new path's error
against the float32 reference and the kernel. Not a test (timing; issue 23, docs/perf.md session 24).

Run: .venv/bin/python tests/perf/cpu_int4_prefill.py [--threads 1,2] [--rows 17,32,64,157,512] [--repeats 3]
Each cell: the mean over --repeats of each repeat's median of --calls calls, ± half the spread of those repeats.

End to end, before/after in one tree: `... cpu_int4_prefill.py --prefill-rows N bonsai bench|eval MODEL [flags]` runs
that bonsai command with engine.runtime.cpu_int4.PREFILL_ROWS = N (1000000: every call on the int4 kernel, as before),
and the native kernels' (engine.runtime.cpu_kquant) the same: `--prefill-rows 1000000 bonsai eval …` scores the rows
a decode step computes.
`... cpu_int4_prefill.py prompt MODEL [--draft] [--category summarization] [--threads 1]`: one model's prefill of a
coder-suite prompt, kernel only and with the GEMM path alternated in one process (--draft: the model rounded to 4-bit
codes as a CPU draft model is, engine.speculative.cpu_draft)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.runtime import cpu_int4
from engine.runtime.cpu_int4 import PREFILL_ROWS, Int4CpuLinear, int4_matmul
from engine.runtime.cpu_int4_prefill import layout_known, prefill_matmul

SHAPES = [(8960, 1536), (1536, 8960), (1536, 1536), (256, 1536), (4864, 896), (896, 4864)]  # 1.5B, 0.5B (N, K)


def layer(n: int, k: int, halves: int = 1) -> Int4CpuLinear:
    """Random codes, Q4_K-like positive scales and zero points (the speed does not depend on the values)."""
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, halves * k), generator=gen, dtype=torch.uint8)  # [N, K']
    s = torch.rand(n, halves * k // 32, generator=gen) * 0.01 + 1e-3  # [N, K'/32]
    z = torch.randn(n, halves * k // 32, generator=gen) * 0.01  # [N, K'/32]
    return Int4CpuLinear(codes, s, z, in_features=k)


def median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def errors(lin: Int4CpuLinear, rows: int) -> str:
    """The new path's max abs / relative error against x·Wᵀ in float32 (the bfloat16 pairs' exact matrix) and
    against the int4 kernel, on bfloat16-exact inputs; relative: to the largest output."""
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()  # [M, K]
    ref = x.float() @ lin.dequantized().t()  # [M, N]
    new = prefill_matmul(x, lin.packed, lin.sz, lin.out_features, lin.halves).float()
    kernel = int4_matmul(torch.cat([x] * lin.halves, -1), lin.packed, lin.sz).float()
    scale = float(ref.abs().max())
    parts = [f"{name} max abs {float((new - other).abs().max()):.3g} rel {float((new - other).abs().max()) / scale:.2g}"
             for name, other in (("vs float32", ref), ("vs kernel", kernel))]
    return f"|y| max {scale:.3g}; " + "; ".join(parts) + \
        f"; kernel vs float32 max abs {float((kernel - ref).abs().max()):.3g}"


def cli(argv: list[str], prefill_rows: int) -> None:
    """A bonsai command (argv: its arguments) with this threshold."""
    from bonsai_cli.main import main as bonsai
    from engine.runtime import cpu_kquant
    cpu_int4.PREFILL_ROWS = cpu_kquant.PREFILL_ROWS = prefill_rows  # either kernel set
    sys.argv = ["bonsai", *argv]
    bonsai()


def prompt(argv: list[str]) -> None:
    """Seconds of a model's prefill of one suite prompt, old (PREFILL_ROWS huge) and new alternated."""
    from engine.bench.suites import load_suite
    from engine.runtime.runner import ModelRunner
    from engine.sources import store
    from engine.speculative.cpu_draft import four_bit_drafter
    from engine.weights.loader import load_model
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft", action="store_true")
    ap.add_argument("--category", default="summarization")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(store.resolve_model(args.model), "cpu", weight_dtype=torch.bfloat16, cpu_int4=True,
                        narrow_head=None if args.draft else "int8")
    if args.draft:
        four_bit_drafter(loaded)
    tok = loaded.tokenizer
    case = load_suite("coder", categories=[args.category])[0]
    ids = tok.encode(tok.apply_chat_template(case.messages))
    runner = ModelRunner(loaded, len(ids) + 1)
    times = {"old": [], "new": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, rows in (("old", 1_000_000), ("new", PREFILL_ROWS)):
            cpu_int4.PREFILL_ROWS = rows
            slot = runner.slot(0)
            slot.reset()
            t0 = time.perf_counter()
            runner.prefill(slot, ids)
            times[name].append(time.perf_counter() - t0)
    cpu_int4.PREFILL_ROWS = PREFILL_ROWS
    old, new = (statistics.mean(times[n][1:]) for n in ("old", "new"))
    spread = {n: (max(times[n][1:]) - min(times[n][1:])) / 2 for n in times}
    print(f"{args.model}{' (4-bit draft)' if args.draft else ''}: prefill of the {args.category} prompt ({len(ids)} "
          f"tokens), {args.threads} thread(s): int4 kernel {old:.2f}±{spread['old']:.2f} s, GEMM path "
          f"{new:.2f}±{spread['new']:.2f} s ({old / new:.2f}x)")


def main() -> None:
    if "prompt" in sys.argv[1:2]:
        return prompt(sys.argv[2:])
    if "bonsai" in sys.argv:
        at = sys.argv.index("bonsai")
        ap = argparse.ArgumentParser()
        ap.add_argument("--prefill-rows", type=int, default=cpu_int4.PREFILL_ROWS)
        return cli(sys.argv[at + 1:], ap.parse_args(sys.argv[1:at]).prefill_rows)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="17,32,64,157,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--halves", type=int, default=1, choices=(1, 2), help="2: Q5/Q8 codes as two 4-bit halves")
    args = ap.parse_args()
    assert layout_known(), "the int4 kernel's packed layout differs here: the new path is off"
    rows_list = [int(r) for r in args.rows.split(",")]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s), halves={args.halves}: ms per call, int4 kernel / decode + GEMM (speedup)")
        print("| N x K | " + " | ".join(f"M={m}" for m in rows_list) + " |")
        print("|---|" + "---|" * len(rows_list))
        for n, k in SHAPES:
            lin = layer(n, k, args.halves)
            cells = []
            for m in rows_list:
                x = torch.randn(m, k).bfloat16()  # [M, K]
                wide = torch.cat([x] * lin.halves, -1)  # [M, K']
                old, new = [], []
                for _ in range(args.repeats):
                    old.append(median_ms(lambda: int4_matmul(wide, lin.packed, lin.sz), args.calls))
                    new.append(median_ms(lambda: prefill_matmul(x, lin.packed, lin.sz, n, lin.halves), args.calls))
                mo, mn = statistics.mean(old), statistics.mean(new)
                cells.append(f"{mo:.2f}±{(max(old) - min(old)) / 2:.2f} / {mn:.2f}±{(max(new) - min(new)) / 2:.2f}"
                             f" ({mo / mn:.2f}x)")
            print(f"| {n}x{k} | " + " | ".join(cells) + " |")
    print()
    for n, k in SHAPES[:1] + SHAPES[4:5]:
        print(f"{n}x{k}, M=64, halves={args.halves}: {errors(layer(n, k, args.halves), 64)}")


if __name__ == "__main__":
    main()
