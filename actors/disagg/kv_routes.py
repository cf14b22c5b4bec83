"""Which bytes of a prefill worker's KV cache go where in a decode worker's cache, when the
two replicas shard the model differently (any tp x spp on either side).

A worker's paged cache holds, per layer of its stage, K and V tensors
``[num_blocks, block_size, heads, head_dim]`` over its contiguous range of global KV heads
(``models.sharding.kv_head_range``; with more TP ranks than KV heads, ranks share a head).
A decode worker's cache lies in a shared-memory segment, layer-major, K before V, then
block (``segment_offset``). For one layer, one K or V tensor, and one (source block,
destination block) pair, the bytes to move are the heads both sides hold and the source
sends: the whole block when both sides hold exactly those heads, else one run of
``len(heads) * head_dim`` elements per token.

Each global KV head is sent by one prefill worker per layer: the lowest TP rank of the
stage holding the layer that holds the head (``sent_heads``), so replicated heads are not
written twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from store.transfer import Endpoint

if TYPE_CHECKING:  # torch stays out of what the router imports
    from actors.engine.worker_hooks import CacheGeometry
    from store.kv_cache_ipc import KVCacheExport


@dataclass(frozen=True)
class KVTarget:
    """One decode worker's share of the decode cache."""

    endpoint: Endpoint
    layers: tuple[int, int]  # global layers [lo, hi)
    heads: tuple[int, int]  # global KV heads [lo, hi)
    num_blocks: int
    block_size: int
    head_bytes: int  # one token of one head: head_dim * element size
    kvp_rank: int = 0  # the KV-parallel rank whose pool this cache holds
    # the cache's handles for a prefill worker on the same device (``kv_ipc_route``): set
    # on a GPU, and on the CPU with ``kv_route="ipc"``; None: reached through the endpoint
    export: KVCacheExport | None = None

    @classmethod
    def of_cache(
        cls,
        endpoint: Endpoint,
        layers: tuple[int, int],
        heads: tuple[int, int],
        geometry: CacheGeometry,
        kvp_rank: int,
        export: KVCacheExport | None,
    ) -> KVTarget:
        """A worker's cache of ``geometry``, holding ``layers`` and ``heads``."""
        g = geometry
        head_bytes = g.head_dim * g.dtype.itemsize
        return cls(
            endpoint, layers, heads, g.num_blocks, g.block_size, head_bytes, kvp_rank, export
        )

    @property
    def piece_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V) tensor."""
        return self.block_size * (self.heads[1] - self.heads[0]) * self.head_bytes

    def offset(self, layer: int, kind: int, block: int) -> int:
        """Byte offset of (global ``layer``, K=0 / V=1, ``block``) in the segment."""
        return segment_offset(
            self.num_blocks, self.piece_bytes, layer - self.layers[0], kind, block
        )


def segment_offset(num_blocks: int, piece_bytes: int, layer: int, kind: int, block: int) -> int:
    """Byte offset of (local layer, K=0/V=1, block) in a decode cache segment."""
    return ((2 * layer + kind) * num_blocks + block) * piece_bytes


def sent_heads(
    held: tuple[int, int], tp_rank: int, ranges: list[tuple[int, int]]
) -> tuple[int, int]:
    """What TP rank ``tp_rank`` (holding ``held``; ``ranges``: every rank's range) sends:
    its heads, unless a lower rank holds the same ones (a replicated head), then none.
    Ranges are either equal or disjoint."""
    if any(ranges[r] == held for r in range(tp_rank)):
        return (held[0], held[0])
    return held


def piece_ranges(
    target: KVTarget,
    layer: int,
    held: tuple[int, int],
    sent: tuple[int, int],
    src_piece_bytes: int,
    v_base: int,
    src_blocks: list[int],
    dst_blocks: list[int],
) -> list[tuple[int, int, int]]:
    """``(remote offset, local offset, nbytes)`` copies of one layer's K and V for blocks
    ``src_blocks[i] -> dst_blocks[i]``. Local offsets are into the source layer's K tensor
    followed by its V tensor at ``v_base``; ``held`` are the source's heads, ``sent`` those it
    sends. Empty when the target does not hold ``layer`` or none of the sent heads."""
    if not target.layers[0] <= layer < target.layers[1]:
        return []
    lo, hi = max(sent[0], target.heads[0]), min(sent[1], target.heads[1])
    if lo >= hi:
        return []
    hb, bs = target.head_bytes, target.block_size
    src_heads, dst_heads = held[1] - held[0], target.heads[1] - target.heads[0]
    whole = (lo, hi) == held == target.heads
    run = (hi - lo) * hb
    out: list[tuple[int, int, int]] = []
    for kind, base in ((0, 0), (1, v_base)):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            remote = target.offset(layer, kind, d)
            local = base + s * src_piece_bytes
            if whole:
                out.append((remote, local, src_piece_bytes))
                continue
            for t in range(bs):
                out.append(
                    (
                        remote + (t * dst_heads + lo - target.heads[0]) * hb,
                        local + (t * src_heads + lo - held[0]) * hb,
                        run,
                    )
                )
    return out
