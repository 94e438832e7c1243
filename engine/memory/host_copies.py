"""What KV offload and weight offload share: host memory that the GPU can copy from at full PCIe speed
(pinned), and a side stream that runs those copies while the compute stream works.

On a GPU the copies run on a CUDA side stream; markers (CUDA events) order them against the compute
stream both ways. On the CPU the "host" and "device" tensors are both CPU tensors and the same calls
run: a copy either happens at once, or (`deferred`, for tests) waits in a queue until the compute
side asks for it, the latest moment a real side stream may run it, so a missing wait reads stale
data and a test sees it.
"""
from __future__ import annotations

import ctypes
import logging
import math
import weakref
from typing import Callable

import torch

log = logging.getLogger(__name__)


class HostAllocator:
    """Host tensors for the pools: pinned on a CUDA machine. First page-locked in place with
    cudaHostRegister on a page-aligned region of the exact size (torch's pinned allocator rounds a
    request up to a power of two: 8 GB for a 4.8 GB pool), else from torch's pinned allocator. When
    pinning fails (common on desktops with a low locked-memory limit), the tensor stays pageable and
    one warning says the copies will be slower; never an error."""

    PAGE = 4096

    def __init__(self, pin: bool, what: str, register: Callable[[int, int], int] | None = None):
        self.pin = pin
        self.what = what
        self.pinned_all = pin  # every tensor made so far is pinned
        self._register = register or _cuda_host_register
        self._warned = False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of `shape` (zeroing touches the pages now, as pinning would)."""
        if not self.pin:
            return torch.zeros(shape, dtype=dtype)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        length = -(-nbytes // self.PAGE) * self.PAGE
        raw = torch.zeros(length + self.PAGE, dtype=torch.uint8)
        offset = -raw.data_ptr() % self.PAGE
        region = raw[offset:offset + length]  # page-aligned start and size
        try:
            error = self._register(region.data_ptr(), length)
        except (RuntimeError, OSError, AttributeError) as e:  # no CUDA runtime, a driver refusing
            error = str(e)
        if not error:
            return _registered_tensor(raw, region.data_ptr(), nbytes, shape, dtype)
        del raw, region
        try:
            return self._torch_pinned(shape, dtype)
        except RuntimeError as e:
            error = f"{error}; {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        self.pinned_all = False
        if not self._warned:
            self._warned = True
            log.warning("could not pin %.0f MiB of host memory for the %s (%s): using pageable memory, "
                        "host-to-GPU copies will be slower (raise the locked-memory limit, ulimit -l)",
                        nbytes / 2**20, self.what, error)
        return torch.zeros(shape, dtype=dtype)

    @staticmethod
    def _torch_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)


def _registered_tensor(raw: torch.Tensor, ptr: int, nbytes: int, shape: tuple[int, ...],
                       dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose storage starts at the registered page `ptr` of `raw` (torch's is_pinned, which a
    CUDA-graph capture of a copy consults, asks about a storage's first byte: a view into `raw` would
    start before the registered pages). The buffer object keeps `raw` alive as long as any view of the
    storage, and unregisters the pages before they are freed."""
    buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
    buffer.owner = raw
    weakref.finalize(buffer, _cuda_host_unregister, ptr)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def _cuda_host_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to do
        pass


class CopyStream:
    """Copies between host and device on a side stream, ordered against the compute stream."""

    def __init__(self, device: torch.device, deferred: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.deferred = deferred and not self.cuda
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # CPU deferred copies not yet run
        self._done = 0  # CPU: copies run so far (a marker is a count of copies)

    def after_compute(self) -> None:
        """Copies enqueued from now on start after every compute kernel enqueued so far (a buffer the
        compute stream still reads is not overwritten; rows it wrote are complete)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst ← src on the side stream (asynchronous from/to pinned host memory)."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
        elif self.deferred:
            self._queue.append((dst, src))
        else:
            dst.copy_(src)
            self._done += 1

    def mark(self):
        """A marker after the copies enqueued so far (a CUDA event; on the CPU a count)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        return self._done + len(self._queue)

    def compute_waits(self, marker) -> None:
        """The compute stream waits until the copies before `marker` are done (None: nothing to wait for,
        the copies are ordered before by the stream already)."""
        if marker is None:
            return
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(marker)
            return
        while self._done < marker:
            dst, src = self._queue.pop(0)
            dst.copy_(src)
            self._done += 1

    def synchronize(self) -> None:
        """Every copy enqueued so far is complete (the host may read what they wrote)."""
        if self.cuda:
            self.stream.synchronize()
        else:
            self.compute_waits(self._done + len(self._queue))
