"""Each packed product of the decode step asks L2 for the start of the next one's weights (issue 19).

A decode step's products run one after another with small kernels between them (activation quantization,
rope, attention), and each product is too short to keep HBM busy from its first byte to its last: its loads
start only when the kernel does, and its tail, its atomics and the small kernels after it leave HBM idle. So
every packed GEMV of the step, once its own groups are read, asks L2 (`prefetch.global.L2`) for the first
`cap` bytes of the next product's words (quant.kernels.gemv_parts._prefetch_share): HBM streams them during
the gaps, and the next product finds them in L2. The last product of a step (the output layer) prefetches
the first of the next step.

The order is the step's own: recorded while the step runs eagerly (the graph capture's warm-ups always run
it eagerly first), so it cannot drift from the code of the step; a captured step replays the links it had.

Off by default until measured on a GPU (built in session 22 without device time): BONSAI_L2_PREFETCH=2 turns
it on (after each program's last group), =1 at the programs' start; tests/perf/gpu_prefetch_ab.sh measures
both against off in one run (docs/pending-gpu-runs.md).
"""
from __future__ import annotations

import os

import torch

from engine.errors import BonsaiError
from quant.packed_layout import PackedWeight

# Share of the device's L2 one product's prefetch may take (the product after it streams through L2 with
# evict_first loads; the prefetched lines must survive until read). A guess until tests/perf/gpu_prefetch_ab.sh
# compares L2/8, L2/4 and L2/2 (docs/perf.md, session 22).
L2_SHARE = 0.25
AT_END = 2  # quant.kernels.packed_gemv's prefetch_at: after the program's last group (1: at its start)
DEFAULT_MODE = "0"  # BONSAI_L2_PREFETCH when unset: off until measured


class PrefetchChain:
    """Links each packed weight of a step to (the first cap bytes of) the next one's words."""

    def __init__(self, cap_bytes: int, at: int = AT_END):
        self.cap_bytes, self.at = cap_bytes, at
        self._order: list[PackedWeight] = []  # this step's products so far
        self._next: dict[int, torch.Tensor] = {}  # words' data_ptr → what that product prefetches

    def begin(self) -> None:
        self._order = []

    def visit(self, pw: PackedWeight) -> torch.Tensor | None:
        """Record pw as the step's next product; what it should prefetch (from the last step's order)."""
        self._order.append(pw)
        return self._next.get(pw.words.data_ptr())

    def end(self) -> None:
        """The step is over: link its products in order (the last to the first) for the next steps."""
        order = self._order
        links = {}
        for i, pw in enumerate(order):
            nxt = order[(i + 1) % len(order)]
            if nxt is not pw and nxt.words.is_contiguous():
                words = nxt.words.view(-1)  # [n] int32
                links[pw.words.data_ptr()] = words[:self.cap_bytes // words.element_size()]
        self._next = links


def make_chain(device: torch.device) -> PrefetchChain | None:
    """The chain of a decode step whose products run as Triton kernels (on the CPU: interpreted, the tests,
    as if the L2 held 4 MB), with BONSAI_L2_PREFETCH=2 (after each program's last group) or 1 (at the
    programs' start); None with 0, the default until tests/perf/gpu_prefetch_ab.sh has measured it."""
    mode = os.environ.get("BONSAI_L2_PREFETCH", DEFAULT_MODE)
    if mode not in ("0", "1", "2"):
        raise BonsaiError(f"BONSAI_L2_PREFETCH must be 0 (off), 1 (at the programs' start) or 2 (after their "
                          f"last group), got '{mode}'")
    if mode == "0":
        return None
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 4 << 20
    return PrefetchChain(int(l2 * L2_SHARE), at=int(mode))
