"""The one-row packed GEMV in CUDA C++ (NVRTC at run time, quant.kernels.cuda_rt): decode's small products.

Same maths and layout as quant.kernels.packed_gemv (words [K·BITS/32, N] int32, scales [K/G, N] float16, int8
activations with a scale and a code sum a group; y[n] += sw[g, n]·sx[g]·(MULT·Σ u·xq − OFFSET·sumx[g])), for the
≤ 2-bit layouts (tri, bin) at group 128. What it does that the Triton kernels could not (issue 19, measured with
tests/perf/cuda_gemv_probe.py on an H100, docs/perf.md session 31): every thread requests all of its weight words
as 16-byte loads before it waits for the previous kernel (PDL) or computes, so a small product's bytes are all in
flight at once — 0.66-0.92x the Triton kernel's time on q/k/v, o and down of the 8B / 27B-class shapes.

Grid: 4 output columns a thread, 128 a warp (blockIdx.x); WARPS warps a block, each GPW whole groups of K, the
blocks along blockIdx.y split K further and add with atomics (one float a column a block). The reference on every
device is packed_gemv_reference (the CPU's path); tests/test_cuda_gemv.py compiles every variant the engine
launches for sm_90 and sm_86 without a GPU and, on one, checks each against the reference.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from quant.packed_layout import PackedWeight, layout_kind

log = logging.getLogger(__name__)

SOURCE = (Path(__file__).resolve().parent / "cuda_gemv_row.cu").read_text()  # the kernel: gemv_row

GROUP = 128
KINDS = ("tri", "bin")
DEFAULT_CONFIG = (4, 1)  # (warps a block, groups a warp): best or within 4% on 12 of the 16 measured shapes
# Measured on an H100 (tests/perf/cuda_gemv_probe.py, 2026-12-07, µs a call with PDL, graph replays over rotated
# copies; Triton with PDL — today's kernel — in brackets): the best config per (kind, N, K); None where Triton
# stays faster. Shapes not listed take DEFAULT_CONFIG (it beat Triton on 15 of the 16).
MEASURED: dict[tuple[str, int, int], tuple[int, int] | None] = {
    ("tri", 6144, 4096): (4, 1),    # 8B q/k/v      3.73 [4.58]
    ("tri", 4096, 4096): (4, 1),    # 8B o          2.96 [4.07]
    ("tri", 24576, 4096): (4, 1),   # 8B gate/up   11.42 [12.60]
    ("tri", 4096, 12288): (4, 1),   # 8B down       6.02 [7.02]
    ("tri", 7168, 5120): (8, 1),    # 27B q/k/v     4.78 [5.87]
    ("tri", 5120, 5120): (8, 1),    # 27B o         3.76 [5.71]
    ("tri", 34816, 5120): (4, 2),   # 27B gate/up  18.90 [20.74]
    ("tri", 5120, 17408): None,     # 27B down     10.38 [9.88]: Triton's kwarps kernel
    ("bin", 6144, 4096): (4, 1),    # 8B q/k/v      4.08 [4.89] (without PDL; 4.2 with)
    ("bin", 4096, 4096): (4, 1),    # 8B o          3.57 [3.99]
    ("bin", 24576, 4096): (8, 1),   # 8B gate/up    7.64 [8.99]
    ("bin", 4096, 12288): (4, 2),   # 8B down       5.23 [7.46]
    ("bin", 7168, 5120): (4, 2),    # 27B q/k/v     4.87 [5.27]
    ("bin", 5120, 5120): (8, 1),    # 27B o         3.72 [4.93]
    ("bin", 34816, 5120): (4, 1),   # 27B gate/up  12.31 [15.66]
    ("bin", 5120, 17408): (4, 1),   # 27B down      7.62 [9.12]
}


def config_for(kind: str, group_size: int, out_features: int, in_features: int) -> tuple[int, int] | None:
    """(warps, groups a warp) of the CUDA C++ one-row product of this matrix, or None where it does not run it
    (another layout or group size, columns not a multiple of 4, or measured slower than Triton)."""
    if kind not in KINDS or group_size != GROUP or out_features % 4 or in_features % GROUP:
        return None
    return MEASURED.get((kind, out_features, in_features), DEFAULT_CONFIG)


NORM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # NW_KIND: the RMSNorm weight's dtype
ROUND_KINDS = {torch.bfloat16: 1, torch.float16: 2}  # NW_KIND of INPUT 3: the dtype combined heads are rounded to
INPUTS = {"int8": 0, "norm": 1, "swiglu": 2, "splits": 3}  # INPUT: what the kernel is given (see SOURCE)


def defines(kind: str, warps: int, gpw: int, pdl: bool, floor: bool = False, norm: int | None = None,
            swiglu: bool = False, splits: int | None = None) -> dict[str, int]:
    """The -D values of one compiled variant: int8 activations given, or (norm: NW_KIND) the float row it
    normalizes and quantizes itself, or (swiglu) the [gate | up] rows it takes SwiGLU of and quantizes, or
    (splits: ROUND_KINDS' value) a split attention's partials it combines, rounds and quantizes."""
    lk = layout_kind(kind)
    given = "splits" if splits else "swiglu" if swiglu else "int8" if norm is None else "norm"
    return {"BITS": lk.bits, "MULT": lk.mult, "OFFSET": lk.offset, "GROUP": GROUP, "WARPS": warps, "GPW": gpw,
            "FLOOR": int(floor), "USE_PDL": int(pdl), "INPUT": INPUTS[given], "NW_KIND": norm or splits or 0}


def engine_configs() -> list[tuple[int, int]]:
    """Every (warps, groups a warp) the engine may launch: the measured ones and the default."""
    return sorted({c for c in MEASURED.values() if c is not None} | {DEFAULT_CONFIG})


def engine_variants(arch: int) -> list[dict[str, int]]:
    """Every variant the engine may launch on sm_`arch` (what CI compiles): each kind × config × input (int8, the
    float row with each norm weight dtype, SwiGLU rows, attention partials rounded to each 16-bit dtype), with PDL
    on sm_90+."""
    configs = engine_configs()
    pdls = (False, True) if arch >= 90 else (False,)
    inputs = [{}] + [{"norm": n} for n in NORM_KINDS.values()] + [{"swiglu": True}] \
        + [{"splits": k} for k in ROUND_KINDS.values()]
    return [defines(kind, w, g, pdl, **i) for kind in KINDS for w, g in configs for pdl in pdls for i in inputs]


# The down product takes its SwiGLU input itself (BONSAI_CUDA_GEMV_INPUT=auto) from this many inputs. Measured on an
# H100 (tests/perf/cuda_gemv_step.py, 2026-12-07, the graphed one-row step, µs): dense 27B-class ternary (down
# 5120×21504) 4,097 → 3,972; Qwen3-8B (down 4096×12288) ternary 1,534 → 1,551, 1-bit 1,299 → 1,314.
SWIGLU_FROM_IN_FEATURES = 16384


def fused_inputs() -> str:
    """Which products make their own int8 activations (BONSAI_CUDA_GEMV_INPUT): "auto" (the default: those after
    an RMSNorm, and down where it has ≥ SWIGLU_FROM_IN_FEATURES inputs), "all" (every down too), "norm" (after
    an RMSNorm only) or "int8" (none: a quantization kernel first)."""
    mode = os.environ.get("BONSAI_CUDA_GEMV_INPUT", "auto")
    if mode not in ("auto", "all", "norm", "int8"):
        raise ValueError(f"BONSAI_CUDA_GEMV_INPUT={mode!r}: use auto, all, norm or int8")
    return mode


def enabled(device: torch.device) -> bool:
    """Whether one-row products on `device` may take the CUDA C++ kernel: a CUDA device, not the Triton
    interpreter, BONSAI_CUDA_GEMV not 0, and NVRTC loadable (where it is not, Triton runs; said once)."""
    if getattr(device, "type", None) != "cuda" or os.environ.get("BONSAI_CUDA_GEMV", "1") == "0":
        return False
    from quant.kernels import interpreting
    return not interpreting() and nvrtc_ready()


@functools.cache
def nvrtc_ready() -> bool:
    from quant.kernels.cuda_rt import CudaCompileError, nvrtc
    try:
        nvrtc()
        return True
    except CudaCompileError as e:
        log.warning("the CUDA C++ decode kernels are off (Triton runs instead): %s", str(e).splitlines()[0])
        return False


def norm_input_taken(x: torch.Tensor, norm_weight: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether the decode step hands this product its float row with the norm (cuda_norm_gemv) instead of int8
    activations from a quantization kernel: one row on the CUDA C++ path of this matrix, the fusion not turned off
    (BONSAI_CUDA_GEMV_INPUT=int8), a float32 row aligned for 16-byte loads."""
    if x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_contiguous() or x.data_ptr() % 16:
        return False
    if norm_weight.dtype not in NORM_KINDS or not norm_weight.is_contiguous():
        return False
    if fused_inputs() == "int8" or not enabled(x.device):
        return False
    return config_for(pw.kind, pw.group_size, pw.out_features, pw.in_features) is not None


def swiglu_input_taken(device: torch.device, down: PackedWeight) -> bool:
    """Whether a one-row step may hand the down product its [gate | up] rows (cuda_swiglu_gemv): the CUDA C++ path
    of this matrix and the fusion on for it (fused_inputs). The caller must then zero the gate/up buffer
    before the next gate/up product adds into it (the decode step has the next q/k/v product do it)."""
    mode = fused_inputs()
    if mode not in ("auto", "all") or not enabled(device):
        return False
    if mode == "auto" and down.in_features < SWIGLU_FROM_IN_FEATURES:
        return False
    return config_for(down.kind, down.group_size, down.out_features, down.in_features) is not None


def splits_input_taken(device: torch.device, pw: PackedWeight, head_dim: int) -> bool:
    """Whether a one-row step may hand this product (o_proj) its attention's split partials (cuda_splits_gemv)
    instead of int8 activations: heads of 128 dims (a group a head), the CUDA C++ path of this matrix, the fused
    inputs not turned off (BONSAI_CUDA_GEMV_INPUT=int8)."""
    if head_dim != GROUP or fused_inputs() == "int8" or not enabled(device):
        return False
    return config_for(pw.kind, pw.group_size, pw.out_features, pw.in_features) is not None


def describe(kind: str, group_size: int, out_features: int, in_features: int) -> str | None:
    """What `bonsai bench` reports for the CUDA C++ path of this matrix ("cuda w4 g1 split 8"), None if not taken."""
    config = config_for(kind, group_size, out_features, in_features)
    if config is None:
        return None
    return f"cuda w{config[0]} g{config[1]} split {_splits(in_features // GROUP, *config)}"


def _splits(num_groups: int, warps: int, gpw: int) -> int:
    return -(-num_groups // (warps * gpw))


@functools.cache
def _compiled(device_index: int, flags: tuple[tuple[str, int], ...]):
    from quant.kernels.cuda_rt import CudaKernel, compile_cubin
    with torch.cuda.device(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        return CudaKernel(compile_cubin(SOURCE, 10 * major + minor, dict(flags), name="gemv_row.cu"), "gemv_row")


def _kernel(device_index: int, flags: dict[str, int]):
    """The loaded kernel of one variant on one device (compiled and loaded once)."""
    return _compiled(device_index, tuple(sorted(flags.items())))


def cuda_gemv(xq: torch.Tensor, sx: torch.Tensor, sumx: torch.Tensor, pw: PackedWeight,
              out: torch.Tensor | None = None, accumulate: bool = False,
              config: tuple[int, int] | None = None) -> torch.Tensor:
    """y [1, N] float32 = x Wᵀ for one row of int8 activations (xq [1, K], sx / sumx [1, K/G]); with accumulate,
    out += y. Launched on torch's current stream of xq's device (captured into graphs), with PDL where the Triton
    kernels use it. config: (warps, groups a warp), else config_for's."""
    assert xq.shape[0] == 1 and xq.dtype == torch.int8 and sx.dtype == torch.float32 and sumx.dtype == torch.int32
    return _launch(xq, xq.shape[1], pw, out, accumulate, config, defines_input={}, head=[xq, sx, sumx])


def cuda_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, pw: PackedWeight,
                   out: torch.Tensor | None = None, accumulate: bool = False,
                   config: tuple[int, int] | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] float32 = RMSNorm(x)·w quantized to int8 per group, times Wᵀ, in one launch (no activation
    quantization kernel before it): x float32 [1, K] contiguous, norm_weight [K] float32 / bfloat16 / float16.
    Equal to packed_gemv_reference(*quantize_activations_reference(x, 128, norm_weight, eps), pw) up to the
    float rounding of the row's sum of squares. zero: a float32 buffer the kernel sets to 0 once the kernels
    before it are done (PDL), e.g. a split-K target read by the kernel before."""
    from quant.kernels.cuda_rt import f32
    assert x.shape[0] == 1 and x.dtype == torch.float32 and x.data_ptr() % 16 == 0
    assert norm_weight.is_contiguous() and norm_weight.numel() == x.shape[1]
    return _launch(x, x.shape[1], pw, out, accumulate, config, defines_input={"norm": NORM_KINDS[norm_weight.dtype]},
                   head=[x, norm_weight], eps=f32(eps), zero=zero)


def cuda_swiglu_gemv(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, accumulate: bool = False,
                     config: tuple[int, int] | None = None) -> torch.Tensor:
    """y [1, N] float32 = (silu(gate)·up quantized to int8 per group) Wᵀ, in one launch: x float32 [1, 2K] holds
    gate and up. Equal to packed_gemv_reference(*quantize_activations_reference(x, 128, gated=True), pw) up to
    exp's rounding. x is left as it is (the caller zeroes a split-K buffer)."""
    assert x.shape[0] == 1 and x.dtype == torch.float32 and x.data_ptr() % 16 == 0 and x.shape[1] % 2 == 0
    return _launch(x, x.shape[1] // 2, pw, out, accumulate, config, defines_input={"swiglu": True}, head=[x])


def cuda_splits_gemv(part: torch.Tensor, ml: torch.Tensor, group: int, dtype: torch.dtype, pw: PackedWeight,
                     out: torch.Tensor | None = None, accumulate: bool = False,
                     config: tuple[int, int] | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] float32 = (attention heads combined from their splits, rounded to dtype, int8 per head) Wᵀ in one
    launch: part float32 [KV, S, GP, 128] (each split's output, GP ≥ group query heads a kv head), ml [KV, S, GP, 2]
    (each split's max score, in log2 units, and its sum of 2^(score - max)); the product's input is the KV·group
    heads. Equal to splits_gemv_reference up to float rounding. zero: as cuda_norm_gemv's."""
    from quant.kernels.cuda_rt import i32
    kv, ns, gp, d = part.shape
    assert part.dtype == ml.dtype == torch.float32 and part.is_contiguous() and ml.is_contiguous()
    assert ml.shape == (kv, ns, gp, 2) and d == GROUP and group <= gp and kv * group * d == pw.in_features
    assert 1 <= ns <= 32 and part.data_ptr() % 16 == 0
    return _launch(part, pw.in_features, pw, out, accumulate, config, defines_input={"splits": ROUND_KINDS[dtype]},
                   head=[part], zero=zero, splits_args=[ml, i32(ns), i32(group), i32(gp)])


def combine_splits_reference(part: torch.Tensor, ml: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The heads [1, KV·group·D] float32 from split partials (part [KV, S, GP, D], ml [KV, S, GP, 2]: max in log2
    units, sum): Σ_s 2^(m_s − m) o_s / Σ_s 2^(m_s − m) l_s, rounded to dtype (flash-decoding's last step)."""
    kv, _, _, d = part.shape
    m, lsum = ml[:, :, :group, 0], ml[:, :, :group, 1]  # [KV, S, G]
    mx = m.amax(dim=1, keepdim=True)  # [KV, 1, G]
    f = torch.exp2(m - torch.where(mx == float("-inf"), torch.zeros_like(mx), mx))  # [KV, S, G]
    total = (lsum * f).sum(dim=1)  # [KV, G]
    o = (part[:, :, :group] * f[..., None]).sum(dim=1)  # [KV, G, D]
    o = o / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return o.to(dtype).float().reshape(1, kv * group * d)


def splits_gemv_reference(part: torch.Tensor, ml: torch.Tensor, group: int, dtype: torch.dtype,
                          pw: PackedWeight) -> torch.Tensor:
    """What cuda_splits_gemv computes, on any device: the combined heads quantized per head, then the product."""
    from quant.kernels.act_quant import quantize_activations_reference
    from quant.kernels.gemv_parts import packed_gemv_reference
    heads = combine_splits_reference(part, ml, group, dtype)  # [1, H·D]
    return packed_gemv_reference(*quantize_activations_reference(heads, GROUP), pw)


def _launch(x: torch.Tensor, k: int, pw: PackedWeight, out, accumulate: bool, config, defines_input: dict,
            head: list[torch.Tensor], eps=None, zero: torch.Tensor | None = None,
            splits_args: list | None = None) -> torch.Tensor:
    """One launch of gemv_row: head are the input tensors (xq, sx, sumx; or x and the norm weight; or x)."""
    from quant.kernels import pdl_enabled
    from quant.kernels.cuda_rt import f32, i32, ptr
    from quant.kernels.gemv_parts import result_buffer
    import ctypes
    warps, gpw = config or config_for(pw.kind, pw.group_size, pw.out_features, pw.in_features) or DEFAULT_CONFIG
    assert k == pw.in_features and pw.group_size == GROUP and x.is_contiguous() and pw.words.is_contiguous()
    assert pw.words.data_ptr() % 16 == 0 and pw.scales.data_ptr() % 8 == 0 and pw.out_features % 4 == 0
    assert pw.scales.dtype == torch.float16
    ng, n = k // GROUP, pw.out_features
    grid = (-(-n // 128), _splits(ng, warps, gpw))
    out = result_buffer(out, 1, n, x.device, accumulate, grid[1])
    assert out.is_contiguous() and out.dtype == torch.float32
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    pdl = pdl_enabled(x.device)
    flags = defines(pw.kind, warps, gpw, pdl, **defines_input)
    kernel = _kernel(device, flags)
    if flags["INPUT"]:
        assert zero is None or (zero.is_contiguous() and zero.dtype == torch.float32 and zero.device == x.device)
        if splits_args is not None:  # partials, (max, sum), splits, group, padded group
            args = [ptr(x), ptr(splits_args[0]), *splits_args[1:], i32(k)]
        else:
            nw = ptr(head[1]) if len(head) > 1 else ctypes.c_void_p(0)
            args = [ptr(x), nw, eps if eps is not None else f32(0.0), i32(k)]
        args += [ptr(zero) if zero is not None else ctypes.c_void_p(0), i32(zero.numel() if zero is not None else 0)]
    else:
        args = [ptr(t) for t in head]
    args += [ptr(pw.words), ptr(pw.scales), ptr(out), i32(n), i32(ng), i32(accumulate)]
    kernel.launch(grid, (warps * 32,), args, pdl=pdl, stream=torch.cuda.current_stream(x.device).cuda_stream)
    return out
