"""What one model step needs to know about the paged KV cache of its batch.

A step runs a flat batch of T query tokens drawn from B sequences. Sequence b owns the
query rows ``query_start[b]:query_start[b+1]``; they are its newest tokens, so the last of
them sits at position ``context_lens[b] - 1`` and the first at
``context_lens[b] - (query_start[b+1] - query_start[b])``. Its KV lives in the blocks
``block_tables[b, :ceil(context_lens[b] / block_size)]``.

KV cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A slot is ``block_id * block_size + offset``; ``slot_mapping[t]`` is where query token t's
own K and V are written before attention reads the cache.

KV-parallel shards generalise this: a sequence's keys may be one shard of its context
(positions ``[a, a + context_lens[b])``) while its queries sit elsewhere. ``query_offsets[b]``
is then the position of its first query relative to the first key (``start - a``); query
row i sees key j iff ``j <= query_offsets[b] + i`` and ``j < context_lens[b]``. A negative
offset means early queries precede the shard (they see nothing of it); an offset at or past
``context_lens[b]`` means every key precedes them. ``None`` is the usual case, the queries are
the newest tokens: ``query_offsets = context_lens - query_lens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start: torch.Tensor  # [B + 1] int64, cumulative query lengths, query_start[0] == 0
    context_lens: torch.Tensor  # [B] int64, KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    max_query_len: int
    max_context_len: int
    query_offsets: torch.Tensor | None = None  # [B] int64; see the module docstring

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        query_offsets: list[int] | None = None,
        slot_mapping: list[int] | None = None,
    ) -> AttentionMetadata:
        """Build from plain lists: one entry per sequence, in batch order. With
        ``query_offsets``, give ``slot_mapping`` too (any slots; -1 for none)."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry each")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        if query_offsets is not None:
            if slot_mapping is None or len(query_offsets) != len(query_lens):
                raise ValueError("query_offsets needs one offset per sequence and a slot_mapping")
            slots = slot_mapping
        else:
            slots = []
            for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
                for pos in range(ctx - q, ctx):
                    slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start=torch.tensor(starts, dtype=torch.int64, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            query_offsets=None
            if query_offsets is None
            else torch.tensor(query_offsets, dtype=torch.int64, device=device),
        )


@dataclass
class FixedDecodeMetadata(AttentionMetadata):
    """A pure-decode step in a fixed shape (one batch-size bucket of the decode graph runner,
    ``actors/engine/decode_graphs.py``): one query per row, ``query_start = arange(B + 1)``,
    ``block_tables [B, W]`` with ``W`` fixed, ``max_context_len = W * block_size`` (the
    table's capacity, an upper bound). Some rows may be padding (see
    ``actors/engine/decode_padding.py``).

    Its tensors are static buffers whose values change between replays of a captured CUDA
    graph without any Python running again: a backend must not read them on the host
    (``.item()``, ``.tolist()``, shapes that depend on values) nor cache work on the
    object's identity across steps. Backends that can run it so say ``graph_safe_decode =
    True``; any other backend treats it as ordinary metadata (correct eagerly, never
    captured). The runner makes a new object per forward, so work computed on the device
    from its buffers may be shared by the layers of one forward (``key_mask``): in a
    captured graph the first layer's kernels recompute it on every replay."""

    _key_masks: dict[int, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def key_mask(self, key_len: int) -> torch.Tensor:
        """``[B, key_len]`` bool: True where key ``j`` is at or past row ``b``'s context
        (``j >= context_lens[b]``, masked). Made by the first layer that asks, shared by the
        others of the forward."""
        mask = self._key_masks.get(key_len)
        if mask is None:
            keys = torch.arange(key_len, device=self.context_lens.device)
            mask = self._key_masks[key_len] = keys[None, :] >= self.context_lens[:, None]
        return mask
