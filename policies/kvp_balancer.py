"""Medha's KVP load balancer (section 4.3): which KV-parallel rank a new request starts on.

A request's first shard (its first ``rank_token_limit`` tokens) lives on the rank it starts
on, and its prompt is computed there until it spills to the next rank. A new request goes to
the rank with the least prefill work queued once it is added: the prompt tokens admitted
requests still have to compute on that rank, plus this request's prompt tokens there that
are not already cached (a prefix hit is work saved). Only ranks with enough free blocks for
its first shard qualify; if none has, the one with the most free blocks (it will wait for
memory there). Ties: more free blocks, then the lower rank. Pure: plain numbers in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KVRankLoad(Protocol):
    """One rank as the KV manager sees it (``store.kv_sharded_manager.RankLoad``)."""

    @property
    def rank(self) -> int: ...

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens admitted requests still compute on this rank."""
        ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def new_tokens(self) -> int:
        """The new request's tokens not cached on this rank."""
        ...


def choose_kvp_rank(ranks: Sequence[KVRankLoad], need_blocks: int) -> int:
    """The rank a new request starts on, needing ``need_blocks`` for its first shard."""
    if not ranks:
        raise ValueError("need at least one rank")
    fits = [r for r in ranks if r.free_blocks >= need_blocks]
    if not fits:
        return max(ranks, key=lambda r: (r.free_blocks, -r.rank)).rank
    best = min(fits, key=lambda r: (r.pending_tokens + r.new_tokens, -r.free_blocks, r.rank))
    return best.rank
