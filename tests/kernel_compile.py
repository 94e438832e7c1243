"""Compile every Triton kernel variant for a CUDA architecture on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code that the compiler refuses
(session 5's Hadamard rotation rebound a constexpr inside a static loop: fine in the interpreter, a
CompilationError on the H200). This script puts a stand-in CUDA driver in place that reports the
chosen architecture, makes every kernel launch a compile-only warm-up (Triton's full pipeline, down
to ptxas and a cubin), and calls each kernel entry point with small CPU tensors in every variant the
engine launches (KV types, rotations, splits, weight kinds, gemv variants, PDL on Hopper). Outputs
are garbage: nothing runs. Must run without TRITON_INTERPRET (the interpreter replaces the kernels
when they are defined), so tests/test_kernel_compile.py starts it in a fresh process.

    python -m tests.kernel_compile --arch 90      # prints one line per compiled kernel, exit 1 on a failure
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch


def install_compile_only_driver(arch: int) -> list[tuple[str, int]]:
    """Stand-in driver for `arch` (e.g. 90) and compile-only launches; returns the list that each
    compiled kernel's (name, cubin bytes) is appended to."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyCuda:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileOnlyCuda())
    compiled: list[tuple[str, int]] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, len(kernel.asm.get("cubin", b""))))
        return kernel

    JITFunction.run = compile_only
    return compiled


def attention_cases():
    """Rope/KV-write, decode (1 and 2 splits, the int8-output variant) and prefill kernels for every KV type,
    with the rotations a quantized cache turns on."""
    from engine.kernels.attention_decode import decode_attention, decode_attention_int8
    from engine.kernels.attention_prefill import prefill_attention
    from engine.kernels.rope_cache import qk_norm_rope_write
    from engine.runtime.kv_cache import KVCache
    from engine.sources.model_config import ModelConfig
    h, kv, d = 4, 2, 64
    cfg = ModelConfig(architecture="qwen3", vocab_size=8, hidden_size=h * d, intermediate_size=8, num_layers=1,
                      num_heads=h, num_kv_heads=kv, head_dim=d, qk_norm=True)
    slots, lens = torch.tensor([0, 1, 0], dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int32)
    for kv_type in ("bf16", "int8", "int4", "k8v4"):
        for dtype in (torch.bfloat16, torch.float16):
            cache = KVCache(cfg, 64, num_slots=2, dtype=dtype, device="cpu", kv_type=kv_type)
            norms = [torch.ones(d, dtype=dtype)] * 2
            name = f"{kv_type} {str(dtype)[6:]}"
            yield f"rope+write {name}", lambda: qk_norm_rope_write(
                torch.randn(3, (h + 2 * kv) * d), torch.tensor([0, 1, 2]), slots, torch.ones(d // 2),
                cache.k[0], cache.v[0], h, kv, d, *norms, out_dtype=dtype, **cache.layer_write_args(0))
            read = cache.layer_read_args(0)
            q = torch.randn(3, h, d, dtype=dtype)  # [M, H, D]
            for splits in (1, 2):
                yield f"decode {name} splits={splits}", lambda: decode_attention(
                    q, cache.k[0], cache.v[0], slots, lens, d ** -0.5, splits, **read)
            if kv_type != "bf16":
                yield f"decode int8-out {name}", lambda: decode_attention_int8(
                    q, cache.k[0], cache.v[0], slots, lens, d ** -0.5, 2, **read)
            yield f"prefill {name}", lambda: prefill_attention(
                torch.randn(1, h, 16, d, dtype=dtype), cache.k[0], cache.v[0], torch.tensor([1], dtype=torch.int32),
                torch.tensor([8], dtype=torch.int32), d ** -0.5, **read)


def packed_cases():
    """Activation quantization, the GEMV variants, GEMM and the dequantizer for every weight kind."""
    from quant.kernels.act_quant import quantize_activations, quantize_activations_reference
    from quant.kernels.packed_dequant import dequantize_t
    from quant.kernels.packed_gemm import packed_gemm
    from quant.kernels.packed_gemv import packed_gemv
    from quant.packed_layout import KINDS, random_packed
    k, g = 256, 64
    for mode in ("plain", "norm", "gated"):
        yield f"act-quant {mode}", lambda: quantize_activations(
            torch.randn(3, 2 * k if mode == "gated" else k), g, torch.ones(k) if mode == "norm" else None,
            gated=mode == "gated")
    xq1 = quantize_activations_reference(torch.randn(1, k), g)
    xq4 = quantize_activations_reference(torch.randn(4, k), g)
    for kind in KINDS:
        pw = random_packed(kind, 64, k, g, generator=torch.Generator().manual_seed(0))
        yield f"gemv {kind} 1 row", lambda: packed_gemv(*xq1, pw)
        yield f"gemv {kind} 1 row accumulate", lambda: packed_gemv(*xq1, pw, out=torch.zeros(1, 64), accumulate=True)
        for variant in ("2d", "rows"):
            yield f"gemv {kind} 4 rows {variant}", lambda: packed_gemv(*xq4, pw, config=(32, 2, 1), variant=variant)
        yield f"gemm {kind}", lambda: packed_gemm(torch.randn(32, k, dtype=torch.bfloat16), pw)
        yield f"dequantize {kind}", lambda: dequantize_t(pw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 89: RTX 40, 86: RTX 30)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run without TRITON_INTERPRET=1: the interpreter replaces the kernels it should compile", file=sys.stderr)
        return 2
    import quant.kernels
    quant.kernels.pdl_enabled = lambda device: args.arch >= 90  # compile the PDL variants where they exist
    compiled = install_compile_only_driver(args.arch)
    failures = 0
    for label, call in [*attention_cases(), *packed_cases()]:
        before = len(compiled)
        try:
            call()
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the exit code says it
            failures += 1
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(f"FAILED {label}: {type(error).__name__}: {first}")
            if os.environ.get("BONSAI_DEBUG"):
                traceback.print_exc()
            continue
        names = sorted({name for name, size in compiled[before:]})
        empty = [name for name, size in compiled[before:] if size == 0]
        if not names or empty:
            failures += 1
            print(f"FAILED {label}: {'no kernel was compiled' if not names else 'no cubin for ' + ', '.join(empty)}")
        else:
            print(f"ok {label}: {', '.join(names)}")
    print(f"sm_{args.arch}: {len(compiled)} kernel compilations, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
