"""One 8-row tensor-core product (packed_mma) and one 1-row GEMV at the Qwen3-8B gate/up shape (ternary, g128), three
calls each, for Nsight Compute to profile (stall reasons, occupancy, L1/L2/DRAM throughput: what a timing sweep
cannot tell apart).

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy -k regex:packed -c 1 \\
        python3 tests/perf/mma_ncu.py --x-ahead 1 --word-rows 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from quant.kernels.act_quant import quantize_activations  # noqa: E402
from quant.kernels.packed_gemv import packed_gemv  # noqa: E402
from quant.kernels.packed_mma import packed_mma  # noqa: E402
from quant.packed_layout import random_packed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="128,4,4,2", help="BLOCK_N,split,warps,stages of the 8-row product")
    ap.add_argument("--x-ahead", type=int, default=1)
    ap.add_argument("--word-rows", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = tuple(int(v) for v in args.config.split(","))
    pw = random_packed("tri", 24576, 4096, 128, device=dev, generator=torch.Generator(dev).manual_seed(0))
    for rows in (8, 1):
        xq = quantize_activations(torch.randn(rows, 4096, device=dev), 128)
        out = torch.zeros(rows, 24576, device=dev)
        for _ in range(3):
            if rows == 8:
                packed_mma(*xq, pw, out, True, config, False, args.x_ahead, bool(args.word_rows))
            else:
                packed_gemv(*xq, pw, out=out, accumulate=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
