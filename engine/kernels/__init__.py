"""Triton kernels of the GPU fast path, each with a plain-torch reference beside it.

Nothing here imports triton at package import time: `engine.model` and the CLI work on machines
without it. Import a kernel module (`engine.kernels.attention_decode`, ...) only after
`triton_available()` said yes. On a CPU the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, read when a kernel module is imported), which is how CI tests them.
"""
from __future__ import annotations

import importlib.util
import os


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


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
