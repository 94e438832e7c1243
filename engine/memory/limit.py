"""Enforcing `max_gpu_memory` on the device while running.

On CUDA, `torch.cuda.set_per_process_memory_fraction(limit / total)` before loading: PyTorch's
caching allocator then cannot reserve more than the limit (an allocation past it frees cached
blocks and retries, then raises OutOfMemoryError, which `within_limit` turns into a one-line
BonsaiError naming the stage). After loading and after CUDA-graph capture `check_usage` compares
the allocator's numbers with the limit and the plan. Memory outside the allocator (the CUDA
context, loaded kernels) is not counted by either. On the CPU there is no allocator limit: the
plan check before loading still applies, nothing bounds the process while it runs.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch

from engine.errors import BonsaiError
from engine.memory.budget import format_bytes

log = logging.getLogger(__name__)


def limit_device_memory(limit: int, device: torch.device | str) -> float | None:
    """Cap the caching allocator of a CUDA device at `limit` bytes; the fraction set (None on CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        log.info("max_gpu_memory on %s: no allocator limit exists on the CPU; only the plan was checked", device)
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if limit > total:
        raise BonsaiError(f"max_gpu_memory {format_bytes(limit)} is more than {device} has "
                          f"({format_bytes(total)}); lower it or remove it")
    fraction = limit / total
    # "cuda" names the current device; the allocator's limit is set per device index
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def usage(device: torch.device | str) -> dict[str, int]:
    """The allocator's current and peak allocated / reserved bytes (zeros on the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0, "peak_reserved": 0}
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


def check_usage(limit: int | None, device: torch.device | str, stage: str, planned: int | None = None
                ) -> dict[str, int]:
    """After a stage (load, graph capture): the allocator must be within the limit; log the numbers."""
    used = usage(device)
    if torch.device(device).type != "cuda":
        return used
    if limit is not None and used["reserved"] > limit:
        raise BonsaiError(f"after {stage} the GPU allocator holds {format_bytes(used['reserved'])}, over "
                          f"max_gpu_memory {format_bytes(limit)}")
    log.info("GPU memory after %s: %s allocated (peak %s), %s reserved%s", stage, format_bytes(used["allocated"]),
             format_bytes(used["peak_allocated"]), format_bytes(used["reserved"]),
             f"; plan {format_bytes(planned)}" if planned else "")
    if planned is not None and used["peak_allocated"] > planned:
        log.warning("GPU peak %s after %s is above the plan's %s", format_bytes(used["peak_allocated"]), stage,
                    format_bytes(planned))
    return used


@contextmanager
def within_limit(limit: int | None, stage: str) -> Iterator[None]:
    """Turn the allocator's refusal (the limit reached) into a one-line BonsaiError."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        if limit is None:
            raise
        raise BonsaiError(f"max_gpu_memory {format_bytes(limit)} was reached while {stage}: the run needs more "
                          "than the plan says; lower the context or slots, or raise the limit") from None
