"""Triton kernels for packed weights, each with a plain-torch reference beside it.

Triton is imported lazily (`triton_available`) so the rest of bonsai runs where it is missing.
Under `TRITON_INTERPRET=1` every kernel runs on the CPU (the tests); inline PTX (dp4a) is then
replaced by the same integer maths written out (`use_asm=False`).
"""
from __future__ import annotations

import os


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
