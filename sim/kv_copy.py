"""Copying a cached prefix from one instance's block pool into another's.

The simulator's stand-in for a KV transfer (Mooncake's ``TransferKVCache`` and hot-block
replication): it moves no bytes, it makes the destination's real ``BlockPool`` hold the same
blocks (allocated, registered under the same chained hashes and tokens, then released into
the cached state) so later prefix matches there hit. Uses only the pool's public API.

Invariants: only a prefix the source still holds is copied (chained hashes: stop at the
first block the source lacks); blocks the destination already has are kept, not duplicated;
the destination's prefix blocks are held (ref counted) while the copy allocates, so the
copy cannot evict the head of the very chain it extends.
"""

from __future__ import annotations

from collections.abc import Sequence

from store.block_pool import BlockPool


def copy_prefix(
    src: BlockPool, dst: BlockPool, hashes: Sequence[int], tokens: Sequence[int], num_blocks: int
) -> int:
    """Make ``dst`` hold the first ``num_blocks`` blocks of the chain ``hashes``; returns how
    many leading blocks ``dst`` holds afterwards (at most ``num_blocks``)."""
    bs = dst.block_size
    if src.block_size != bs:
        raise ValueError("source and destination block sizes differ")
    held: list[int] = []  # dst blocks pinned during the copy
    todo: list[int] = []  # chain positions dst lacks and src has
    for i in range(min(num_blocks, len(hashes))):
        h = hashes[i]
        block_tokens = tokens[i * bs : (i + 1) * bs]
        if not todo:
            b = dst.lookup(h, block_tokens)
            if b is not None:
                dst.acquire(b)
                held.append(b)
                continue
        if src.lookup(h, block_tokens) is None:
            break
        todo.append(i)
    n = min(len(todo), dst.num_free)
    new = dst.allocate(n) if n else []
    for i, b in zip(todo[:n], new, strict=True):
        dst.register(b, hashes[i], tokens[i * bs : (i + 1) * bs])
    chain = held + new
    dst.release(chain[::-1])  # tail first: the head outlives the tail in eviction order
    return len(chain)
