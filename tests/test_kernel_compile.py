"""Every Triton kernel variant compiles for real GPUs, checked without one (tests/kernel_compile.py).

The other kernel tests run in Triton's interpreter, which accepts code the compiler refuses; this one
runs Triton's whole compiler (to a cubin, through ptxas) for Hopper (sm_90, with PDL) and for the
consumer cards our users own (sm_86: RTX 30). A fresh process: the interpreter must be off there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", [90, 86])
def test_every_kernel_compiles_for_the_gpu(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernel_compile", "--arch", str(arch)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert run.returncode == 0 and not failed, "\n".join(failed) or run.stderr[-3000:]
    compiled = {name for line in run.stdout.splitlines() if line.startswith("ok ")
                for name in line.split(": ", 1)[1].split(", ")}
    assert compiled >= {"_qk_norm_rope_write_kernel", "_decode_split_kernel", "_combine_splits_kernel",
                        "_prefill_kernel", "_quantize_kernel", "_packed_gemv_kernel", "_packed_gemv_rows_kernel",
                        "_packed_gemm_kernel", "_dequant_t_kernel"}
