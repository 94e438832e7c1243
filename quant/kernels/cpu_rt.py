"""The CPU kernels of cpu_kquant.c compiled on first use with the machine's C compiler, called by ctypes.

    lib = library()                      # None where no compiler works (the caller keeps torch's kernels)
    acts = quantize_rows(x, kp, group)   # float32 [M, K] → int8 codes, scales, sums per 16
    matmul(packed_tensors, acts, y, n0)  # y[:, n0:n0 + N] = x @ Wᵀ for one packed matrix
    Layer(parts, k).run(x)               # a layer of parts in one call (kq_linear)
    BlockStep(...).run(...)              # a whole transformer block's rows in one call (kq_block)

The compiler is `cc` (BONSAI_CC names another) with -O3 -march=native -fopenmp: the library is built for the
CPU it runs on, cached under ~/.cache/bonsai/kernels (BONSAI_KERNEL_CACHE) by a hash of the source, flags and
compiler, written under a temporary name and renamed. Its OpenMP runtime is torch's: both name libgomp.so.1,
which torch has loaded by then, so the two share one pool of threads. `vector()` says whether a vector body was
compiled in — AVX512-VNNI, or AVX2 + FMA + F16C (`body()` names it) — else every call runs the portable C loops:
right, but slower than torch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from quant.kquant_pack import FORMATS

SOURCE = Path(__file__).with_name("cpu_kquant.c")
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_kquant_avx512.h", "cpu_kquant_avx2.h",
                                                            "cpu_kquant_step.h"))
BODIES = {0: None, 1: "avx512-vnni", 2: "avx2"}  # kq_vector() → the vector body's name
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11")
FORMAT_IDS = FORMATS  # a packed format's id in the C calls (quant.kquant_pack names them)


class CpuCompileError(RuntimeError):
    """The C compiler is missing or refused the kernels (the message carries its output)."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("BONSAI_CC", "cc"))


def cache_dir() -> Path:
    return Path(os.environ.get("BONSAI_KERNEL_CACHE") or Path.home() / ".cache" / "bonsai" / "kernels")


def build(flags: tuple[str, ...] = FLAGS, out: Path | None = None) -> Path:
    """Compile the kernels (cached by content); the path of the shared library. CpuCompileError on failure."""
    cc = compiler()
    if cc is None:
        raise CpuCompileError(f"no C compiler ({os.environ.get('BONSAI_CC', 'cc')}) on PATH: install gcc or clang, "
                              "or set BONSAI_CC")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuCompileError(f"{cc} does not run: {e}") from None
    text = SOURCE.read_text() + "".join(h.read_text() for h in HEADERS)
    key = hashlib.sha256("\0".join([text, version, *flags]).encode()).hexdigest()[:16]
    target = out or cache_dir() / f"cpu_kquant-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([cc, *flags, "-I", str(SOURCE.parent), str(SOURCE), "-o", tmp, "-lm"],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise CpuCompileError(f"{cc} could not compile {SOURCE.name}:\n{(run.stderr or run.stdout).strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.kq_vector.restype = i
    lib.kq_quantize.argtypes = [p, i, i, i, i, p, p, p, i]
    lib.kq_natural.argtypes = [i, i]
    lib.kq_natural.restype = i
    lib.kq_matmul.argtypes = [i, p, p, p, i, i, p, p, p, i, p, i, i, i]
    lib.kq_dequant_bf16.argtypes = [i, p, p, p, i, i, i, p, i]
    lib.kq_linear.argtypes = [i, p, p, p, p, p, p, i, p, i, p, i]
    lib.kq_linear.restype = i
    lib.kq_dequant_rows.argtypes = [i, p, p, p, p, i, i, p]
    lib.kq_dequant_rows.restype = None
    lib.kq_block.argtypes = [p, p, p, i, p, p, i, i, p, p, p, p, i, i]
    lib.kq_near_top.argtypes = [p, p, p, ctypes.c_float, i, i, i, p, p]
    lib.kq_near_top.restype = None
    lib.kq_block.restype = i
    for fn in (lib.kq_quantize, lib.kq_matmul, lib.kq_dequant_bf16):
        fn.restype = None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU, or None where they cannot be built (the reason: `build_error`)."""
    try:
        return load(build())
    except (CpuCompileError, OSError):
        return None


@functools.cache
def build_error() -> str | None:
    """Why `library()` is None (one line), else None."""
    try:
        load(build())
        return None
    except (CpuCompileError, OSError) as e:
        return str(e).splitlines()[0]


def vector() -> bool:
    return body() is not None


def body(lib: ctypes.CDLL | None = None) -> str | None:
    """The vector body the kernels run ("avx512-vnni", "avx2"), None for the portable loops or no library."""
    lib = lib or library()
    return None if lib is None else BODIES[lib.kq_vector()]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def quantize_rows(x: torch.Tensor, kp: int, order: int, lib: ctypes.CDLL | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] → (codes int8 [M, 2·kp]: per row q1 then the residual's q2, in the `order` a format's kernel
    reads (kquant_pack.ACT_ORDER); units u float32 [M, kp/32] (x ≈ u·(254·q1 + q2)); u times the sums of
    254·q1 + q2 float32 [M, kp/S]: S = 16 for order 2, else 32)."""
    lib = lib or library()
    x = x.contiguous().float()
    m, k = x.shape
    xq = torch.empty(m, 2 * kp, dtype=torch.int8)
    xd = torch.empty(m, kp // 32, dtype=torch.float32)
    xs = torch.empty(m, kp // (16 if order == 2 else 32), dtype=torch.float32)
    lib.kq_quantize(_ptr(x), m, k, kp, order, _ptr(xq), _ptr(xd), _ptr(xs), torch.get_num_threads())
    return xq, xd, xs


def matmul(fmt: str, qs: torch.Tensor, qh: torch.Tensor, meta: torch.Tensor, n: int, kp: int,
           acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], y: torch.Tensor, n0: int = 0,
           threads: int | None = None, scalar: bool = False, lib: ctypes.CDLL | None = None) -> None:
    """y[:, n0:n0 + n] (float32 [M, ldy], contiguous) = activations @ Wᵀ for one packed matrix."""
    lib = lib or library()
    xq, xd, xs = acts
    assert y.dtype == torch.float32 and y.is_contiguous() and y.shape[0] == xq.shape[0] and xq.shape[1] == 2 * kp
    out = y.data_ptr() + n0 * y.element_size()
    lib.kq_matmul(FORMAT_IDS[fmt], _ptr(qs), _ptr(qh), _ptr(meta), n, kp, _ptr(xq), _ptr(xd), _ptr(xs),
                  xq.shape[0], out, y.shape[1], threads or torch.get_num_threads(), int(scalar))


class Layer:
    """A layer's parts as kq_linear takes them (arrays of formats, plane pointers, rows and widths), built once:
    `run` is then one C call a layer (quantize the input, every part's rows in one parallel loop)."""

    def __init__(self, parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int, int]], k: int):
        self.k, self.n = k, sum(p[4] for p in parts)
        self.keep = [t for p in parts for t in p[1:4]]  # the planes stay alive as long as their pointers
        count = len(parts)
        self.args = ((ctypes.c_int * count)(*[FORMAT_IDS[p[0]] for p in parts]),
                     *[(ctypes.c_void_p * count)(*[_ptr(p[j]) for p in parts]) for j in (1, 2, 3)],
                     (ctypes.c_int * count)(*[p[4] for p in parts]), (ctypes.c_int * count)(*[p[5] for p in parts]))
        self.count = count

    def lin(self) -> "KqLin":
        """These arguments as kq_block takes a product (the Layer must outlive it)."""
        return KqLin(self.count, self.k, *[ctypes.addressof(a) for a in self.args])

    def run(self, x: torch.Tensor, threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        """x float32 [M, K] (contiguous) → float32 [M, N]."""
        lib = lib or library()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if lib.kq_linear(self.count, *self.args, self.k, x.data_ptr(), x.shape[0], y.data_ptr(),
                         threads or torch.get_num_threads()):
            raise MemoryError("the CPU kernels could not allocate the activations' codes")
        return y


def dequant_bf16(fmt: str, qs: torch.Tensor, qh: torch.Tensor, meta: torch.Tensor, n0: int, n1: int, kp: int,
                 threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows n0..n1 of a packed matrix as bfloat16 [n1 − n0, kp]."""
    lib = lib or library()
    out = torch.empty(n1 - n0, kp, dtype=torch.bfloat16)
    lib.kq_dequant_bf16(FORMAT_IDS[fmt], _ptr(qs), _ptr(qh), _ptr(meta), n0, n1, kp, _ptr(out),
                        threads or torch.get_num_threads())
    return out


def dequant_rows(fmt: str, qs: torch.Tensor, qh: torch.Tensor, meta: torch.Tensor, idx: torch.Tensor, kp: int,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Rows `idx` (int64 [C]) of a packed matrix as float32 [C, kp]: its stored values exactly."""
    lib = lib or library()
    idx = idx.to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), kp, dtype=torch.float32)
    if idx.numel():
        lib.kq_dequant_rows(FORMAT_IDS[fmt], _ptr(qs), _ptr(qh), _ptr(meta), _ptr(idx), idx.numel(), kp, _ptr(out))
    return out


def near_top(logits: torch.Tensor, norms: torch.Tensor, a: torch.Tensor, b: float, cap: int = 256,
             lib: ctypes.CDLL | None = None) -> list[torch.Tensor] | None:
    """Per row of logits float32 [M, V] the indices (int64 [C]) that may be its largest under the bound
    norms [V] · a [M] + b (narrow_head.recompute_near_top's selection, one C pass); None if a row has more than cap."""
    lib = lib or library()
    m, v = logits.shape
    idx = torch.empty(m, cap, dtype=torch.int64)
    count = torch.empty(m, dtype=torch.int64)
    lib.kq_near_top(logits.data_ptr(), norms.data_ptr(), a.data_ptr(), b, m, v, cap, idx.data_ptr(), count.data_ptr())
    counts = count.tolist()
    return None if max(counts) > cap else [idx[i, :c] for i, c in enumerate(counts)]


class KqLin(ctypes.Structure):  # cpu_kquant_step.h's kq_lin
    _fields_ = [("nparts", ctypes.c_int), ("k", ctypes.c_int)] + [
        (name, ctypes.c_void_p) for name in ("fmts", "qs", "qh", "meta", "ns", "kps")]


class KqBlock(ctypes.Structure):  # cpu_kquant_step.h's kq_block_t
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "rot_half", "inter")] + [
        ("eps", ctypes.c_float)] + [(name, ctypes.c_void_p) for name in ("attn_norm", "ffn_norm", "qkv_bias")] + [
        (name, KqLin) for name in ("qkv", "o", "gate_up", "down")]


class BlockStep:
    """One transformer block's rows in one C call (kq_block): RMSNorm, q/k/v (+ bias), rotary, the K/V write, one-query
    attention per row over its slot's keys 0..position, o_proj + residual, RMSNorm, gate/up, SwiGLU, down + residual.
    `layers`: the Layers of q/k/v, o, gate/up, down; the norms' weights and the bias float32, contiguous (kept alive
    here with the Layers)."""

    def __init__(self, shape: dict, eps: float, attn_norm: torch.Tensor, ffn_norm: torch.Tensor,
                 qkv_bias: torch.Tensor | None, layers: list[Layer]):
        self.keep = (attn_norm, ffn_norm, qkv_bias, layers)
        self.spec = KqBlock(**shape, eps=eps, attn_norm=_ptr(attn_norm), ffn_norm=_ptr(ffn_norm),
                            qkv_bias=_ptr(qkv_bias), **dict(zip(("qkv", "o", "gate_up", "down"),
                                                               [layer.lin() for layer in layers])))
        self.ref = ctypes.byref(self.spec)

    def run(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int | None = None,
            scalar: bool = False, lib: ctypes.CDLL | None = None) -> torch.Tensor:
        """x float32 [B, T, H] → the block's output [B, T, H]; K/V written into k_cache / v_cache float32
        [slots, KV, S, D] at positions int64 [B, T] of slots int64 [B]; cos / sin float32 [B, T, .., rot_half].
        Every tensor contiguous (the caller checks)."""
        return self.run_on(x, cache_args(k_cache, v_cache), rows_args(positions, slots, cos, sin, threads, scalar),
                           lib or library())

    def run_on(self, x: torch.Tensor, kv: tuple, rows: tuple, lib: ctypes.CDLL) -> torch.Tensor:
        """`run` with its pointers made beforehand (kv: `cache_args`, rows: `rows_args`; their tensors alive):
        the decode step's call, made once a layer."""
        out = torch.empty_like(x)  # [B, T, H]
        if lib.kq_block(self.ref, *kv, x.data_ptr(), out.data_ptr(), *rows):
            raise MemoryError("the CPU kernels could not allocate a block's buffers")
        return out


def cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """A layer's K/V cache [slots, KV, S, D] as kq_block takes it: the two pointers and S."""
    return k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2]


def rows_args(positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              threads: int | None = None, scalar: bool = False) -> tuple:
    """A pass's rows as kq_block takes them (the same for every layer): B, T, the pointers, threads, body."""
    b, t = positions.shape
    return (b, t, positions.data_ptr(), slots.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            threads or torch.get_num_threads(), int(scalar))
