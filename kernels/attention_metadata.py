"""What one model step needs to know about the paged KV cache of its batch.

A step runs a flat batch of T query tokens drawn from B sequences. Sequence b owns the
query rows ``query_start[b]:query_start[b+1]``; they are its newest tokens, so the last of
them sits at position ``context_lens[b] - 1`` and the first at
``context_lens[b] - (query_start[b+1] - query_start[b])``. Its KV lives in the blocks
``block_tables[b, :ceil(context_lens[b] / block_size)]``.

KV cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A slot is ``block_id * block_size + offset``; ``slot_mapping[t]`` is where query token t's
own K and V are written before attention reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from plain lists: one entry per sequence, in batch order."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry each")
        starts = [0]
        slots: list[int] = []
        for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            starts.append(starts[-1] + q)
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
        )
