"""Linear layers whose weights are packed low-bit codes (`quant.packed_layout`).

On a CUDA device with Triton the product runs in the packed kernels: int8 activations and dp4a
for up to 16 rows (decode, verify), tensor-core tiles for more (prefill). Elsewhere (the CPU, a
GPU without Triton) the plain-torch references run the same maths, so every path is testable.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from engine.kernels import kernels_usable
from engine.pipeline.naming import global_name, layer_index
from engine.runtime.linear import Linear
from engine.weights.formats import WeightFormat, linear_formats, require_packable, rounded_format
from quant import grids
from quant.packed_layout import PackedWeight, pack, random_packed, word_rows

GEMV_MAX_ROWS = 4  # rows the plain-torch reference takes as int8 products (the CPU); more: a float matmul
# Rows the packed kernels take on CUDA (dp4a, or tensor cores from a few rows: quant.kernels.packed_gemv.
# default_variant); more are unpacked to bf16 for cuBLAS. Measured on an H200 (tests/perf/gpu_issue20.py
# --sections paths): at 5-16 rows the packed kernels take 19-56% of unpack + cuBLAS's time (8B tri gate/up,
# 16 rows: 36.6 µs against 116.6).
KERNEL_MAX_ROWS = 16


def packed_rows_limit(cuda_kernels: bool) -> int:
    """Up to how many rows a packed layer's product stays packed (see GEMV_MAX_ROWS, KERNEL_MAX_ROWS)."""
    return KERNEL_MAX_ROWS if cuda_kernels else GEMV_MAX_ROWS


class PackedLinear(nn.Module):
    """y = x Wᵀ (+ b) with W a PackedWeight held as two buffers (words, scales)."""

    def __init__(self, pw: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.group_size = pw.kind, pw.group_size
        self.in_features, self.out_features = pw.in_features, pw.out_features
        self.register_buffer("words", pw.words)  # [K/E, N] int32
        self.register_buffer("scales", pw.scales)  # [K/G, N] float16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.unpack_slice_bytes = 0  # prefill's Wᵀ unpacked whole, or in slices of this many bytes (set_unpack_slice)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.kind, self.words, self.scales, self.out_features, self.in_features,
                            self.group_size)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)  # [M, K]
        y = packed_matmul(x2, self.packed, self.unpack_slice_bytes)  # [M, N]
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


# Prefill unpacks a packed matrix to a float Wᵀ for cuBLAS: whole (slice_bytes 0: the default, the fastest) or, under
# max_gpu_memory (engine.memory.budget.run_settings), in column slices of FIT_UNPACK_SLICE_BYTES (a 27B model's whole
# gate/up Wᵀ is 356-440 MB in bf16: a segment that size may not be had in a nearly full budget). Measured on an H200
# (tests/perf/prefill_slices.py, 512-token graphed prefill, generated ternary weights): Qwen3.6-27B shape 86.5 ms in
# 64 MB slices, 69.7 whole; dense 27B 76.6 → 58.2; Qwen3-8B 21.1 → 17.2 (each slice pays its copies, its launches
# and a narrower GEMM; the L2 does not keep a slice between its write and its read).
FIT_UNPACK_SLICE_BYTES = 64 << 20


def unpack_columns(n: int, k: int, element_bytes: int, slice_bytes: int = 0) -> int:
    """Output columns unpacked at once for an [N, K] matrix: all N (slice_bytes 0), else a multiple of 128
    within slice_bytes (at least 128)."""
    if slice_bytes <= 0:
        return n
    cols = max(128, slice_bytes // (k * element_bytes) // 128 * 128)
    return min(cols, n)


def set_unpack_slice(model: nn.Module, slice_bytes: int) -> None:
    """Every packed layer of `model` unpacks its prefill Wᵀ in slices of `slice_bytes` (0: whole), as planned."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.unpack_slice_bytes = slice_bytes


def column_slice(pw: PackedWeight, n0: int, n1: int) -> PackedWeight:
    """Output columns n0..n1 of a packed matrix (its words and scales copied contiguous)."""
    return PackedWeight(pw.kind, pw.words[:, n0:n1].contiguous(), pw.scales[:, n0:n1].contiguous(), n1 - n0,
                        pw.in_features, pw.group_size)


def packed_matmul(x: torch.Tensor, pw: PackedWeight, slice_bytes: int = 0) -> torch.Tensor:
    """x [M, K] @ Wᵀ: the kernels on CUDA (packed_gemv up to KERNEL_MAX_ROWS rows; for more, the codes
    unpacked to a bf16 Wᵀ — whole, or in column slices of slice_bytes — and cuBLAS's tensor-core GEMM), the
    references elsewhere (same maths)."""
    fast = kernels_usable(x.device)
    small = x.shape[0] <= packed_rows_limit(fast)
    if fast:
        if small:
            from quant.kernels.act_quant import quantize_activations
            from quant.kernels.packed_gemv import packed_gemv
            return packed_gemv(*quantize_activations(x.contiguous(), pw.group_size), pw)
        from quant.kernels.packed_dequant import dequantize_t
        return _sliced_matmul(x, pw, lambda part: dequantize_t(part, x.dtype), slice_bytes)
    from quant.packed_layout import dequantize
    if small:
        from quant.kernels.act_quant import quantize_activations_reference
        from quant.kernels.packed_gemv import packed_gemv_reference
        return packed_gemv_reference(*quantize_activations_reference(x, pw.group_size), pw)
    x = x.float()
    return _sliced_matmul(x, pw, lambda part: dequantize(part).t(), slice_bytes)


def _sliced_matmul(x: torch.Tensor, pw: PackedWeight, unpack_t, slice_bytes: int) -> torch.Tensor:
    """x [M, K] @ unpack_t(W)ᵀ, unpacking at most slice_bytes of W at a time (0: all of it)."""
    n = pw.out_features
    cols = unpack_columns(n, pw.in_features, x.element_size(), slice_bytes)
    if cols >= n:
        return torch.matmul(x, unpack_t(pw))  # [M, N]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [M, N]
    for n0 in range(0, n, cols):
        n1 = min(n0 + cols, n)
        out[:, n0:n1] = torch.matmul(x, unpack_t(column_slice(pw, n0, n1)))  # [M, n1 - n0]
    return out


# Loading rounds and packs a float matrix this many weights at a time (whole rows), straight into
# its final packed buffers: the temporaries (float32 groups, codes, int64 fields) stay a few tens of
# MB whatever the matrix (a 27B model's gate/up is 220 M weights).
QUANTIZE_SLICE_ELEMENTS = 1 << 21
# peak temporaries per weight of one slice: float32 groups, codes, int64 fields and their shifted
# sums (measured on the CPU with tests/live_bytes.py: tri 45.1, tri5 45.3, the others 19.0, from bf16 rows)
QUANTIZE_BYTES_PER_ELEMENT = {"tri": 46, "tri5": 46, "bin": 20, "int4": 20, "int8": 20}


def quantize_slice_rows(in_features: int) -> int:
    return max(1, QUANTIZE_SLICE_ELEMENTS // in_features)


def quantize_transient(kind: str, out_features: int, in_features: int, source_bytes: int = 4) -> int:
    """Peak bytes of `quantize_rows`' temporaries on the device for an [N, K] matrix: one slice of
    rows in the source's dtype moved over, and the rounding and packing temporaries of that slice."""
    rows = min(out_features, quantize_slice_rows(in_features))
    return rows * in_features * (source_bytes + QUANTIZE_BYTES_PER_ELEMENT[kind])


def empty_packed(kind: str, out_features: int, in_features: int, group_size: int,
                 device: torch.device | str) -> PackedWeight:
    """The final buffers of a packed [N, K] matrix, filled by `quantize_rows` (or a checkpoint's codes)."""
    require_packable(kind, out_features, in_features, group_size)
    return PackedWeight(kind, torch.empty(word_rows(kind, in_features), out_features, dtype=torch.int32, device=device),
                        torch.empty(in_features // group_size, out_features, dtype=torch.float16, device=device),
                        out_features, in_features, group_size)


def _rtn(w: torch.Tensor, kind: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("tri", "tri5"):
        return grids.ternary_rtn(w, group_size)
    if kind == "bin":
        return grids.binary_rtn(w, group_size)
    return grids.int_rtn(w, 4 if kind == "int4" else 8, group_size)


def quantize_rows(pw: PackedWeight, row0: int, w: torch.Tensor) -> None:
    """Round rows row0 .. row0 + R of pw's matrix, given as floats w [R, K] (any device), onto the
    kind's grid (RTN, quant.grids) and pack them into pw's columns, QUANTIZE_SLICE_ELEMENTS at a time.
    Rounding is per row (groups run along K), so the result is that of rounding the whole matrix."""
    assert w.shape[1] == pw.in_features and row0 + w.shape[0] <= pw.out_features, (tuple(w.shape), row0)
    step = quantize_slice_rows(pw.in_features)
    for r0 in range(0, w.shape[0], step):
        part = w[r0:r0 + step].to(pw.words.device)  # [r, K]
        codes, scales = _rtn(part, pw.kind, pw.group_size)
        packed = pack(pw.kind, codes, scales, pw.group_size)
        del part, codes, scales
        n0 = row0 + r0
        pw.words[:, n0:n0 + packed.out_features].copy_(packed.words)  # [K/E, r]
        pw.scales[:, n0:n0 + packed.out_features].copy_(packed.scales)  # [K/G, r]


def quantize_weight(w: torch.Tensor, kind: str, group_size: int, device: torch.device | str | None = None
                    ) -> PackedWeight:
    """Round a float matrix [N, K] to the kind's grid (RTN, quant.grids) and pack it (on `device`,
    default w's), a slice of rows at a time."""
    n, k = w.shape
    pw = empty_packed(kind, n, k, group_size, device if device is not None else w.device)
    quantize_rows(pw, 0, w)
    return pw


def tensor_generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    """The random generator of one generated (dummy) tensor: seeded by the run's seed and its name."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def pack_linears(model: nn.Module, fmt: WeightFormat, dummy: bool = False, seed: int = 0,
                 device: torch.device | None = None, host_layers: frozenset[int] = frozenset()) -> None:
    """Swap the model's float Linear layers for PackedLinear where the run's format rounds them
    (engine.weights.formats.rounded_format; layers packed from stored codes are PackedLinear by now):
    rounded from the loaded float weights, or random packed codes (dummy), made directly on `device`
    (default: the weights' device; dummy layers may have meta weights, a tied output layer's weight
    may be a host embedding table); the layers of the blocks in host_layers are made in host memory."""
    first = getattr(model, "first_layer", 0)  # a pipeline stage's model: its layers from first_layer
    gives_logits = getattr(model, "gives_logits", True)  # a pipeline stage before the last has no output layer
    if model.lm_head is None and rounded_format("lm_head", fmt).packed and gives_logits:
        emb = model.embed.weight  # tied: the output layer gets its own packed copy
        model.lm_head = Linear(emb.shape[1], emb.shape[0])
        model.lm_head.weight = emb
    formats = linear_formats(model.config, fmt)  # by global name
    targets = []
    for name, module in model.named_modules():
        target = formats.get(global_name(name, first))
        if isinstance(module, Linear) and target is not None and target.packed and (name != "lm_head" or gives_logits):
            targets.append((name, module, target.kind))
    for name, module, kind in targets:
        where = device if device is not None else module.weight.device
        if host_layers and layer_index(global_name(name, first)) in host_layers:
            where = torch.device("cpu")
        if dummy:  # each layer's codes depend on the seed and its (global) name only
            generator = tensor_generator(where, seed, global_name(name, first))
            n, k = module.weight.shape
            pw = random_packed(kind, n, k, fmt.group_size, device=where, generator=generator)
        else:
            pw = quantize_weight(module.weight.data, kind, fmt.group_size, where)
        bias = module.bias.data if module.bias is not None else None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(pw, bias))
        module.weight = None  # free the float copy now


def decode_paths(model: nn.Module) -> dict[str, str]:
    """{"kind N×K gG": kernel} of every packed matrix shape of the model: the one-row kernel the CUDA decode step
    runs for it (quant.kernels.packed_gemv.one_row_path; "cuda …" where the CUDA C++ kernel takes it)."""
    from quant.kernels.cuda_gemv import enabled
    from quant.kernels.packed_gemv import one_row_path
    paths = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            key = f"{module.kind} {module.out_features}×{module.in_features} g{module.group_size}"
            cuda = enabled(module.packed.words.device)
            paths[key] = one_row_path(module.kind, module.group_size, module.out_features, module.in_features, cuda)
    return dict(sorted(paths.items()))
