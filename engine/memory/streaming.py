"""Partial weight offload, planned: which blocks stay resident on the GPU and which stream from host
memory (engine.memory.weight_offload), and what the streamed part predicts for decode speed. Pure
functions of byte counts, no model and no device.

`memory.weight_offload` (engine.run.config):
- false: never stream; a model over memory.max_gpu_memory is refused (the refusal names `auto`).
- auto: stream only what does not fit: as many blocks stay resident as the budget holds after
  everything else the plan counts (KV, activations, the staging ring, ...); the rest stream. Nothing
  streams when everything fits (or without a limit).
- true: stream every block (the smallest GPU footprint, the slowest decode).

Which blocks stream: spread evenly over the depth (`spread`), not the last N. While a streamed block
computes, the side stream copies the next streamed one into the other staging buffer; with resident
blocks in between, their compute runs while that copy crosses PCIe, so the resident part's time
hides under the transfer instead of adding to it (with the last N streaming, the resident part runs
while only the first streamed block's copy is in flight). The output is the same either way.

The prediction: a pass (one decode step, or one verify of k + 1 rows: the same bytes) costs at
least the streamed bytes over the host→device bandwidth, and the resident part at least its bytes
over HBM bandwidth; with the copies overlapped the pass costs the larger of the two, serial their
sum (`predicted_pass_seconds` states the sum: the bound the target is measured against). The
bandwidths are stated defaults (measured on the project's H200: pinned host→GPU 54.9 GB/s over PCIe
gen5 x16, device copy ~4.1 TB/s); a PCIe gen4 x16 card (an RTX 4080-class) gets ~25 GB/s pinned.
"""
from __future__ import annotations

from dataclasses import dataclass

PCIE_BYTES_PER_S = 54.9e9  # pinned host→GPU copies, H200 over PCIe gen5 x16 (docs/perf.md, 2026-11-29 session 4)
PCIE_GEN4_BYTES_PER_S = 25e9  # pinned host→GPU, a PCIe gen4 x16 card (RTX 4080-class), typical measured figure
HBM_BYTES_PER_S = 4.1e12  # device memory read, H200 (the copy yardstick of tests/perf/gpu_kernels.py)
WEIGHT_OFFLOAD_MODES = (False, "auto", True)
STAGING_BUFFERS = 2  # engine.memory.weight_offload.RING


def spread(streamed: int, num_layers: int) -> tuple[int, ...]:
    """`streamed` block indices spread evenly over 0..num_layers-1 (each the middle of its share)."""
    if not 0 <= streamed <= num_layers:
        raise ValueError(f"cannot stream {streamed} of {num_layers} blocks")
    return tuple((2 * j + 1) * num_layers // (2 * streamed) for j in range(streamed))


def streamed_blocks(num_layers: int, weight_offload: bool, resident: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks a run streams: with weight offload every block but the resident ones; else none."""
    if not weight_offload:
        return ()
    keep = set(resident)
    return tuple(i for i in range(num_layers) if i not in keep)


def ring_bytes(layer_bytes: list[int], streamed: tuple[int, ...]) -> int:
    """The GPU staging ring of a streamer of these blocks: min(2, n) buffers of the largest block."""
    if not streamed:
        return 0
    return min(STAGING_BUFFERS, len(streamed)) * max(layer_bytes[i] for i in streamed)


def device_block_bytes(layer_bytes: list[int], streamed: tuple[int, ...], slack: list[int] | None = None) -> int:
    """What the blocks put on the GPU: the resident ones whole (plus their allocator `slack`, if given),
    the streamed ones through the ring."""
    held, extra = set(streamed), slack or [0] * len(layer_bytes)
    return (sum(b + extra[i] for i, b in enumerate(layer_bytes) if i not in held)
            + ring_bytes(layer_bytes, streamed))


def choose_streamed(layer_bytes: list[int], room: int, slack: list[int] | None = None) -> tuple[int, ...] | None:
    """The blocks to stream so that the blocks' GPU bytes (`device_block_bytes`) fit in `room`: the
    fewest, spread over the depth. () when every block fits resident; None when even streaming every
    block (the ring alone) does not fit."""
    n = len(layer_bytes)
    for count in range(n + 1):
        streamed = spread(count, n)
        if device_block_bytes(layer_bytes, streamed, slack) <= room:
            return streamed
    return None


@dataclass(frozen=True)
class StreamPlan:
    """The blocks' split between the GPU and host memory, and the decode speed it predicts."""
    num_layers: int
    streamed: tuple[int, ...]
    streamed_bytes: int  # crossing PCIe every pass
    resident_bytes: int  # every weight read from HBM each pass (resident blocks, embedding rows aside, head)
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    hbm_bytes_per_s: float = HBM_BYTES_PER_S

    @property
    def resident(self) -> tuple[int, ...]:
        held = set(self.streamed)
        return tuple(i for i in range(self.num_layers) if i not in held)

    @property
    def pcie_seconds(self) -> float:
        return self.streamed_bytes / self.pcie_bytes_per_s

    @property
    def hbm_seconds(self) -> float:
        return self.resident_bytes / self.hbm_bytes_per_s

    @property
    def pass_seconds(self) -> float:
        """The bound of one pass: streamed bytes over PCIe plus resident bytes over HBM."""
        return self.pcie_seconds + self.hbm_seconds

    def tokens_per_second(self, accepted_per_pass: float = 1.0) -> float:
        """Predicted decode speed: passes per second × tokens a pass yields (speculation: a verify of
        k + 1 rows streams the same bytes as one token's pass)."""
        return accepted_per_pass / self.pass_seconds if self.pass_seconds > 0 else float("inf")

    def lines(self) -> list[str]:
        """What `bonsai info --plan` prints (a prediction from stated bandwidths, not a measurement)."""
        gb = 1e9
        out = [f"blocks: {len(self.resident)} of {self.num_layers} resident on the GPU, {len(self.streamed)} streamed "
               f"from pinned host memory each pass: layers {layer_ranges(self.streamed) or 'none'}"]
        if self.streamed:
            out.append(f"predicted decode (a bound, not a measurement): {self.tokens_per_second():.1f} tok/s — "
                       f"{self.streamed_bytes / gb:.2f} GB streamed per pass at {self.pcie_bytes_per_s / gb:.1f} GB/s "
                       f"host→GPU = {self.pcie_seconds * 1e3:.1f} ms, plus {self.resident_bytes / gb:.2f} GB resident "
                       f"at {self.hbm_bytes_per_s / 1e12:.1f} TB/s HBM = {self.hbm_seconds * 1e3:.2f} ms")
            out.append(f"with speculation a verify of k + 1 rows streams the same bytes: {self.pass_seconds * 1e3:.1f} ms "
                       f"a pass whatever k, so longer drafts pay off (e.g. 3 tokens accepted per pass: "
                       f"{self.tokens_per_second(3.0):.1f} tok/s); the drafters' planners measure that cost and "
                       "lengthen drafts up to num_draft_tokens")
            gen4 = StreamPlan(self.num_layers, self.streamed, self.streamed_bytes, self.resident_bytes,
                              PCIE_GEN4_BYTES_PER_S, self.hbm_bytes_per_s)
            out.append(f"on a PCIe gen4 x16 card (~{PCIE_GEN4_BYTES_PER_S / gb:.0f} GB/s, HBM aside): "
                       f"{gen4.tokens_per_second():.1f} tok/s")
        return out

    def as_dict(self) -> dict:
        return {"streamed_layers": list(self.streamed), "resident_layers": list(self.resident),
                "streamed_bytes": self.streamed_bytes, "resident_bytes": self.resident_bytes,
                "pcie_bytes_per_s": self.pcie_bytes_per_s, "hbm_bytes_per_s": self.hbm_bytes_per_s,
                "predicted_tokens_per_second": self.tokens_per_second() if self.streamed else None}


def layer_ranges(layers: tuple[int, ...]) -> str:
    """0,1,2,5,7,8 → '0-2, 5, 7-8'."""
    parts: list[tuple[int, int]] = []
    for i in sorted(layers):
        if parts and parts[-1][1] == i - 1:
            parts[-1] = (parts[-1][0], i)
        else:
            parts.append((i, i))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)
