"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API, by ctypes.

Nothing beyond what a CUDA build of torch already brings: libnvrtc ships in torch's CUDA wheels (the
nvidia-cuda-nvrtc package; or a CUDA toolkit's lib64), libcuda with the driver. No nvcc, host compiler,
cuda-python or CuPy. A kernel source is plain CUDA C++ without #include (NVRTC has no system headers;
its built-ins — __ldg, __dp4a, atomicAdd, int4 — need none), specialised by -D defines.

    cubin = compile_cubin(SOURCE, arch=90, defines={"BITS": 2})      # works without a GPU (CI checks it)
    kernel = CudaKernel(cubin, "gemv_row")                           # needs the GPU (torch's context)
    kernel.launch((grid_x, grid_y), (threads,), [ptr(x), ptr(w), ptr(out), i32(n)], pdl=True)

Launches go on torch's current stream, so they are captured into CUDA graphs like any torch or Triton
kernel; `pdl=True` sets programmatic stream serialization (Hopper: the kernel may start while the previous
one finishes; it must wait with `griddepcontrol.wait` before reading that kernel's outputs).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from pathlib import Path

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_CLUSTER_DIMENSION = 4  # CUlaunchAttributeID: value = {x, y, z} unsigned
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute: clusters of more than 8 blocks (H100: up to 16)


class CudaCompileError(RuntimeError):
    """NVRTC refused a source (the message carries its log) or is not installed."""


def _nvrtc_candidates() -> list[str]:
    found = [os.environ["BONSAI_NVRTC"]] if os.environ.get("BONSAI_NVRTC") else []
    for root in sys.path:  # torch's CUDA wheels: site-packages/nvidia/{cuda_nvrtc,cu13}/lib/libnvrtc.so.*
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    by_name = ctypes.util.find_library("nvrtc")
    return [p for p in found if "builtins" not in p and "alt" not in Path(p).name] + ([by_name] if by_name else [])


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """libnvrtc (BONSAI_NVRTC names a file to use); CudaCompileError when none loads."""
    tried = _nvrtc_candidates()
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise CudaCompileError("NVRTC (libnvrtc) was not found: install torch's CUDA build or nvidia-cuda-nvrtc, "
                           "or point BONSAI_NVRTC at libnvrtc.so" + (f" (tried {', '.join(tried)})" if tried else ""))


def _check_nvrtc(code: int, what: str, log: str = "") -> None:
    if code != 0:
        lib = nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        detail = lib.nvrtcGetErrorString(code).decode()
        raise CudaCompileError(f"NVRTC {what} failed ({detail})" + (f":\n{log.strip()}" if log.strip() else ""))


@functools.lru_cache(maxsize=256)
def _compile(source: str, name: str, options: tuple[str, ...]) -> bytes:
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                 "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        code = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        _check_nvrtc(code, f"compiling {name}", log.value.decode(errors="replace"))
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_cubin(source: str, arch: int, defines: dict[str, int] | None = None, name: str = "kernel.cu") -> bytes:
    """Machine code (a cubin) of `source` for sm_`arch` (90: H100/H200, 86: RTX 30xx), each define a -D;
    cached per (source, arch, defines). Raises CudaCompileError with NVRTC's log."""
    options = (f"-arch=sm_{arch}", "-std=c++17") + tuple(f"-D{k}={int(v)}" for k, v in sorted((defines or {}).items()))
    return _compile(source, name, options)


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check_cu(code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(code, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver call {what} failed: {(msg.value or b'?').decode()} ({code})")


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _pdl_attribute() -> _LaunchAttribute:
    attr = _LaunchAttribute()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, ctypes.byref(ctypes.c_int(1)), 4)
    return attr


def _cluster_attribute(dims: tuple[int, int, int]) -> _LaunchAttribute:
    attr = _LaunchAttribute()
    attr.id = _CLUSTER_DIMENSION
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, (ctypes.c_uint * 3)(*dims), 12)
    return attr


def ptr(tensor) -> ctypes.c_void_p:
    """A kernel argument: the device address of a torch tensor."""
    return ctypes.c_void_p(tensor.data_ptr())


def i32(value: int) -> ctypes.c_int:
    return ctypes.c_int(int(value))


def f32(value: float) -> ctypes.c_float:
    return ctypes.c_float(float(value))


class CudaKernel:
    """One __global__ function of a cubin, loaded into torch's CUDA context on the current device."""

    def __init__(self, cubin: bytes, function: str):
        torch.zeros(1, device="cuda")  # torch's (primary) context made current on this thread
        self._image = ctypes.create_string_buffer(cubin, len(cubin))
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
        _check_cu(_driver().cuModuleLoadData(ctypes.byref(self._module), self._image), "cuModuleLoadData")
        _check_cu(_driver().cuModuleGetFunction(ctypes.byref(self._function), self._module, function.encode()),
                  f"cuModuleGetFunction({function})")
        self._pdl = (_LaunchAttribute * 1)(_pdl_attribute())
        self._non_portable = False  # clusters of more than 8 blocks allowed (set at the first such launch)

    def launch(self, grid: tuple[int, ...], block: tuple[int, ...], args: list, pdl: bool = False,
               shared: int = 0, stream: int | None = None, cluster: tuple[int, int, int] | None = None) -> None:
        """Run it on torch's current stream (or `stream`, a CUstream address); args: ctypes values (ptr, i32…);
        cluster: thread-block cluster dimensions (sm_90; more than 8 blocks, the portable size, allowed first)."""
        config = _LaunchConfig()
        config.grid[:] = (tuple(grid) + (1, 1))[:3]
        config.block[:] = (tuple(block) + (1, 1))[:3]
        config.shared = shared
        config.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream if stream is None else stream)
        if cluster:
            if cluster[0] * cluster[1] * cluster[2] > 8 and not self._non_portable:
                _check_cu(_driver().cuFuncSetAttribute(self._function, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                          "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")
                self._non_portable = True
            attrs = [_pdl_attribute()] * pdl + [_cluster_attribute(cluster)]
            table = (_LaunchAttribute * len(attrs))(*attrs)  # alive until the launch returns
            config.attrs, config.num_attrs = ctypes.cast(table, ctypes.POINTER(_LaunchAttribute)), len(attrs)
        elif pdl:
            config.attrs, config.num_attrs = ctypes.cast(self._pdl, ctypes.POINTER(_LaunchAttribute)), 1
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        _check_cu(_driver().cuLaunchKernelEx(ctypes.byref(config), self._function, params, None), "cuLaunchKernelEx")
