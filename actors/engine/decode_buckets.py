"""Which fixed shape a pure-decode step runs in: its batch-size bucket and its block-table width.

A captured CUDA graph replays one fixed shape, so a decode step of ``B`` sequences runs in
the smallest bucket ``N >= B`` (rows ``B..N-1`` padded, ``actors/engine/decode_padding.py``)
and its block tables in a fixed number of columns ``W``: the smallest power of two that holds
the step's longest context, capped at the longest table a sequence can have. A batch above
the largest bucket runs eagerly. Pure: no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

DEFAULT_MAX_BATCH = 256


def default_buckets(max_batch: int = DEFAULT_MAX_BATCH) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to ``max_batch`` (and ``max_batch`` itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= max_batch}
    sizes.update(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def normalize_buckets(sizes: Iterable[int]) -> tuple[int, ...]:
    """``sizes`` sorted, without repeats; ValueError unless they are positive integers."""
    out = sorted(set(sizes))
    if not out or any(type(s) is not int or s < 1 for s in out):
        raise ValueError(f"batch-size buckets must be positive integers, got {list(sizes)!r}")
    return tuple(out)


def choose_bucket(buckets: tuple[int, ...], batch: int) -> int | None:
    """The smallest bucket ``>= batch`` (``buckets`` sorted ascending), or None when the
    batch is above the largest: it then runs eagerly."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one sequence, got {batch}")
    i = bisect_left(buckets, batch)
    return buckets[i] if i < len(buckets) else None


def choose_table_width(needed_blocks: int, max_blocks: int) -> int:
    """Block-table columns of a fixed-shape decode step whose longest context needs
    ``needed_blocks`` blocks: the smallest power of two that holds them, at most
    ``max_blocks`` (the longest table any sequence can have)."""
    if not 1 <= needed_blocks <= max_blocks:
        raise ValueError(f"needed_blocks must be in [1, {max_blocks}], got {needed_blocks}")
    width = 1
    while width < needed_blocks:
        width *= 2
    return min(width, max_blocks)
