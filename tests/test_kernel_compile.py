"""Every Triton kernel signature the engine launches compiles for real GPUs, checked without one (tests/kernel_compile.py).

The other kernel tests run in Triton's interpreter, which accepts code the compiler refuses; this one drives
the engine over every combination a config can select, with Triton's compiler behind every launch, for
Hopper (sm_90, with PDL) and the consumer cards our users own (sm_86: RTX 30), under two Triton versions:
the one this environment installs and 3.6 (pinned by torch 2.11, the GPU stack of our H200 and of many
users; `make install` puts it in .venv/triton-3.6). Four fresh processes (the interpreter must be off
there), run side by side.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT_TRITON = Path(os.environ.get("BONSAI_COMPAT_TRITON", ROOT / ".venv" / "triton-3.6"))
KERNELS = {"_qk_norm_rope_write_kernel", "_decode_split_kernel", "_combine_splits_kernel", "_prefill_kernel",
           "_quantize_kernel", "_packed_gemv_kernel", "_packed_gemv_rows_kernel", "_packed_gemv_kwarps_kernel", "_persistent_ffn_kernel",
           "_packed_gemm_kernel",
           "_dequant_t_kernel", "_tri5_gemv_kernel", "_tri5_rows_kernel", "_dequant_tri5_kernel", "_packed_mma_kernel",
           "_conv_update_kernel", "_recurrent_update_kernel", "_gated_rope_write_kernel", "_gate_project_kernel",
           "_chunk_prepare_kernel", "_chunk_state_kernel", "_chunk_output_kernel", "_causal_conv_kernel",
           "_gated_norm_kernel"}


def _start(arch: int, triton_path: Path | None, cache: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)  # a fresh cache: every signature is really compiled
    if triton_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(triton_path), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "tests.kernel_compile", "--arch", str(arch), "--quiet"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_every_launched_kernel_signature_compiles_for_the_gpu(tmp_path):
    if not (COMPAT_TRITON / "triton").is_dir():
        pytest.skip(f"no Triton 3.6 at {COMPAT_TRITON} (make install puts it there; or set BONSAI_COMPAT_TRITON)")
    runs = {(arch, name): _start(arch, path, tmp_path / f"{name}-{arch}")
            for name, path in (("installed", None), ("3.6", COMPAT_TRITON)) for arch in (90, 86)}
    problems, summaries = [], []
    for (arch, name), proc in runs.items():
        out, err = proc.communicate(timeout=1200)
        summary = [line for line in out.splitlines() if line.startswith(f"sm_{arch}")]
        failed = [line for line in out.splitlines() if line.startswith(("FAILED", "    "))]
        if proc.returncode != 0 or failed or not summary:
            problems.append(f"sm_{arch} triton {name}:\n" + ("\n".join(failed) or err[-3000:]))
            continue
        summaries.append(summary[0])
        if name == "3.6":
            assert "triton 3.6" in summary[0], summary[0]
        kernels = set(summary[0].split("kernels: ", 1)[1].split(";")[0].split(", "))
        assert kernels == KERNELS, f"sm_{arch} triton {name}: compiled {sorted(kernels)}, expected {sorted(KERNELS)}"
    assert not problems, "\n".join(problems)
    print("\n".join(summaries))
