"""Triton kernels of the GPU fast path, each with a plain-torch reference beside it.

Nothing here imports triton at package import time: `engine.runtime.model` and the CLI work on machines
without it. Import a kernel module (`engine.kernels.attention_decode`, ...) only after
`triton_available()` said yes. On a CPU the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel module is imported), which is how CI tests them.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

log = logging.getLogger(__name__)
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores and the dp4a/atomic paths the kernels were checked on


class UnsupportedKernelShape(ValueError):
    """A kernel cannot handle these shapes or dtypes; the caller falls back to the reference path."""


def triton_available(device: str | None = None) -> bool:
    """Whether the Triton kernels can run on `device` ('cuda', 'cpu' or None for 'cuda'):
    triton is installed, and either a CUDA GPU is present or, for 'cpu', the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device is not None and str(device).startswith("cpu"):
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    import torch
    return torch.cuda.is_available()


def kernels_usable(device) -> bool:
    """Whether the Triton kernels run on `device` (a torch.device); when a GPU cannot, say why once
    (the callers then run the plain-torch references). On CPU tensors only when asked
    (BONSAI_KERNELS_ON_CPU=1): the whole engine then runs its kernel paths in Triton's interpreter
    (TRITON_INTERPRET=1), or compiles them without running (tests/kernel_compile.py)."""
    if device.type == "cpu":
        return os.environ.get("BONSAI_KERNELS_ON_CPU", "0") == "1" and importlib.util.find_spec("triton") is not None
    return device.type == "cuda" and _gpu_kernels_usable(device)


@functools.lru_cache(maxsize=None)
def _gpu_kernels_usable(device) -> bool:
    if not triton_available():
        log.warning("triton is not installed: packed layers run through the slow reference path "
                    "(pip install triton)")
        return False
    import torch
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        log.warning("%s (compute capability %d.%d) lacks what the packed kernels need (sm_80+: bf16 tensor "
                    "cores): packed layers run through the slow reference path",
                    torch.cuda.get_device_name(device), *capability)
        return False
    return True


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Shared memory one block may use (the opt-in maximum, bytes) per compute capability x10: a kernel that needs more
# compiles but fails at its first launch (OutOfResources). tests/kernel_compile.py checks every cubin against it.
SHARED_MEMORY_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def target_shared_memory() -> int:
    """SHARED_MEMORY_BYTES of the GPU Triton compiles for now (its current target; under the interpreter the
    largest, unknown architectures the smallest)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return max(SHARED_MEMORY_BYTES.values())
    from triton.runtime import driver
    return SHARED_MEMORY_BYTES.get(driver.active.get_current_target().arch, min(SHARED_MEMORY_BYTES.values()))
