"""Triton kernels for packed weights, each with a plain-torch reference beside it.

Triton is imported lazily (engine.kernels.triton_available) so the rest of bonsai runs where it is missing.
Under `TRITON_INTERPRET=1` every kernel runs on the CPU (the tests); inline PTX (dp4a) is then
replaced by the same integer maths written out (`use_asm=False`).
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_enabled(device) -> bool:
    """Programmatic dependent launch (Hopper and newer): a kernel launched with it may start while
    the previous kernel of the stream finishes; it prefetches what does not depend on that kernel
    (weights) and waits (`gdc_wait`) before touching anything else. BONSAI_PDL=0 turns it off."""
    if interpreting() or os.environ.get("BONSAI_PDL", "1") == "0":
        return False
    return _pdl_supported(getattr(device, "index", None) or 0) if getattr(device, "type", "cuda") == "cuda" else False


_PDL_SUPPORT: dict[int, bool] = {}


def _pdl_supported(index: int) -> bool:
    if index not in _PDL_SUPPORT:
        ok = False
        try:
            import torch
            from triton.backends.nvidia.compiler import CUDAOptions
            from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
            ok = (torch.cuda.is_available() and torch.cuda.get_device_capability(index)[0] >= 9
                  and "launch_pdl" in CUDAOptions.__dataclass_fields__)
        except (ImportError, AttributeError, RuntimeError):
            ok = False
        _PDL_SUPPORT[index] = ok
    return _PDL_SUPPORT[index]


def pdl_options(device) -> dict:
    """Launch keywords of a Triton kernel that has a `USE_PDL` constexpr."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}
