"""How PyTorch's CUDA caching allocator rounds and groups allocations (pure arithmetic, for the memory plan)."""
from __future__ import annotations

MIB = 1 << 20


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _round_block(n: int) -> int:
    return round_up(n, 512)  # the caching allocator's smallest block granularity


def pool_segment_bytes(sizes: list[int]) -> int:
    """What the caching allocator reserves to hold these tensors at once in a private pool: small
    blocks (≤ 1 MiB) in 2 MiB segments, blocks below 10 MiB in 20 MiB segments, larger ones alone
    (rounded to 2 MiB)."""
    small = sum(_round_block(x) for x in sizes if x <= MIB)
    mid = sum(_round_block(x) for x in sizes if MIB < x < 10 * MIB)
    big = sum(round_up(x, 2 * MIB) for x in sizes if x >= 10 * MIB)
    return round_up(small, 2 * MIB) + round_up(mid, 20 * MIB) + big


def rounding_slack(sizes: list[int]) -> int:
    """At most what the allocator's segments of these tensors hold beyond their bytes when each one over
    1 MiB takes a segment of its own rounded up to 2 MiB (an upper bound: a split-off rest may serve others)."""
    return sum(round_up(x, 2 * MIB) - x for x in sizes if x > MIB)
