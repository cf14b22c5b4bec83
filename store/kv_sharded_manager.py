"""Block tables for KV-cache parallelism: one block pool per KVP rank, requests spill.

A request starts on one rank, chosen by ``choose_rank`` from every rank's ``RankLoad``
(prompt tokens admitted requests still compute there, free blocks, the request's own tokens
not cached there) and the blocks its first shard needs: Medha's KVP balancer
(``policies.kvp_balancer``) in the replica controller; by default the rank with the longest
cached prefix of it, then the most free blocks. It holds at most ``rank_token_limit``
tokens there; further tokens spill to the next rank (``(start + i) % kvp``), and so on. So
short requests stay on one rank, and only long ones span ranks. Shards start on block
boundaries (the limit is a multiple of the block size) and each rank holds at most one
shard of a request.

The first shard is an ordinary ``KVCacheManager`` table on its rank, with prefix caching;
spilled shards are private block lists (their KV depends on the first shard's prefix, and a
prefix hit always starts at position 0). Implements the engine's ``KVCache`` protocol
(``actors.engine.kv_cache``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

from store.block_pool import BlockPool
from store.hashing import extend_block_hashes
from store.kv_manager import KVCacheManager

if TYPE_CHECKING:
    from policies.sequence import Sequence

Shard = tuple[int, int, list[int]]  # (rank, first position, block ids)


class RankLoad(NamedTuple):
    rank: int
    pending_tokens: int  # tokens admitted requests still compute on this rank (prefill)
    free_blocks: int
    new_tokens: int  # the new request's tokens not cached on this rank


RankChooser = Callable[[Seq[RankLoad], int], int]  # (loads, first shard's blocks) -> rank


def most_cached_then_free(loads: Seq[RankLoad], need_blocks: int) -> int:
    """The default: the longest cached prefix (fewest new tokens), then most free blocks."""
    return min(loads, key=lambda r: (r.new_tokens, -r.free_blocks, r.rank)).rank


class ShardedKVManager:
    def __init__(
        self,
        pools: list[BlockPool],
        rank_token_limit: int,
        enable_prefix_caching: bool = True,
        choose_rank: RankChooser | None = None,
    ) -> None:
        if not pools:
            raise ValueError("need at least one block pool")
        block_size = pools[0].block_size
        if any(p.block_size != block_size for p in pools):
            raise ValueError("every rank's pool must use the same block size")
        if rank_token_limit <= 0 or rank_token_limit % block_size:
            raise ValueError(
                f"rank_token_limit ({rank_token_limit}) must be a positive multiple of the "
                f"block size ({block_size})"
            )
        self.pools = pools
        self.block_size = block_size
        self.limit = rank_token_limit
        self.managers = [KVCacheManager(p, enable_prefix_caching) for p in pools]
        self.enable_prefix_caching = enable_prefix_caching
        self._start: dict[str, int] = {}  # request id -> rank of its first shard
        self._spilled: dict[str, list[list[int]]] = {}  # blocks on ranks start+1, start+2, ...
        self._seqs: dict[str, Sequence] = {}  # requests holding blocks (the balancer's load)
        self.choose_rank: RankChooser = choose_rank or most_cached_then_free

    @property
    def kvp(self) -> int:
        return len(self.pools)

    @property
    def max_tokens(self) -> int:
        """The longest request the ranks can hold together."""
        return self.kvp * self.limit

    def _cached_blocks(self, rank: int, seq: Sequence) -> int:
        bs = self.block_size
        usable = min((seq.num_tokens - 1) // bs, self.limit // bs)
        pool = self.pools[rank]
        n = 0
        for i, h in enumerate(seq.block_hashes[:usable]):
            if pool.lookup(h, seq.token_ids[i * bs : (i + 1) * bs]) is None:
                break
            n += 1
        return n

    def _choose_start(self, seq: Sequence) -> int:
        if self.enable_prefix_caching:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.salt)
            hits = [self._cached_blocks(r, seq) for r in range(self.kvp)]
        else:
            hits = [0] * self.kvp
        bs = self.block_size
        # its first shard's blocks over its life (prompt + max_tokens, at most the limit)
        first = min(seq.num_prompt_tokens + seq.max_tokens - 1, self.limit)
        pending = self.pending_prefill_tokens()
        loads = [
            RankLoad(r, pending[r], self.pools[r].num_free, seq.num_tokens - hits[r] * bs)
            for r in range(self.kvp)
        ]
        return self.choose_rank(loads, -(-first // bs))

    def pending_prefill_tokens(self) -> list[int]:
        """Per rank: tokens of the requests holding blocks that are neither computed nor in
        flight, each counted on the rank its position falls on (``start + p // limit``)."""
        out = [0] * self.kvp
        for rid, seq in self._seqs.items():
            start = self._start[rid]
            first = seq.num_computed_tokens + seq.num_inflight_tokens
            end = seq.num_tokens
            while first < end - 1:  # more than the newest token: a prefill
                shard = first // self.limit
                upto = min(end, (shard + 1) * self.limit)
                out[(start + shard) % self.kvp] += upto - first
                first = upto
        return out

    # -- KVManager protocol ----------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        rid = seq.request_id
        if rid in self._start:
            raise ValueError(f"request {rid!r} already holds blocks")
        start = self._choose_start(seq)
        self._start[rid] = start
        self._spilled[rid] = []
        self._seqs[rid] = seq
        return self.managers[start].match_prefix(seq)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        rid = seq.request_id
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"request {rid!r} needs {num_tokens} tokens of KV but {self.kvp} ranks of "
                f"{self.limit} tokens hold {self.max_tokens}"
            )
        if rid not in self._start:  # allocation without a prefix match
            self._start[rid] = self._choose_start(seq)
            self._spilled[rid] = []
            self._seqs[rid] = seq
        start = self._start[rid]
        first = self.managers[start]
        # Blocks still needed per rank, checked for every rank before any is taken.
        needs: list[tuple[int, int]] = []
        first_need = first.blocks_needed(min(num_tokens, self.limit)) - len(first.block_table(rid))
        needs.append((start, max(first_need, 0)))
        spilled = self._spilled[rid]
        per_rank = self.limit // self.block_size
        remaining = max(num_tokens - self.limit, 0)
        i = 0
        while remaining > 0:
            rank = (start + 1 + i) % self.kvp
            held = len(spilled[i]) if i < len(spilled) else 0
            want = min(-(-remaining // self.block_size), per_rank)
            needs.append((rank, max(want - held, 0)))
            remaining -= self.limit
            i += 1
        if any(n > self.pools[r].num_free for r, n in needs):
            return False
        if not first.allocate(seq, min(num_tokens, self.limit)):
            return False
        for i, (rank, n) in enumerate(needs[1:]):
            if i == len(spilled):
                spilled.append([])
            if n:
                spilled[i].extend(self.pools[rank].allocate(n))
        return True

    def commit(self, seq: Sequence) -> None:
        start = self._start.get(seq.request_id)
        if start is not None:
            self.managers[start].commit(seq)

    def free(self, seq: Sequence) -> None:
        rid = seq.request_id
        start = self._start.pop(rid, None)
        self._seqs.pop(rid, None)
        if start is None:
            return
        self.managers[start].free(seq)
        for i, blocks in enumerate(self._spilled.pop(rid, [])):
            if blocks:
                self.pools[(start + 1 + i) % self.kvp].release(blocks[::-1])

    # -- views ------------------------------------------------------------------------------
    def shards(self, request_id: str) -> list[Shard]:
        start = self._start.get(request_id)
        if start is None:
            return []
        out: list[Shard] = [(start, 0, self.managers[start].block_table(request_id))]
        for i, blocks in enumerate(self._spilled.get(request_id, [])):
            if blocks:
                out.append(((start + 1 + i) % self.kvp, (i + 1) * self.limit, blocks))
        return out

    def block_table(self, request_id: str) -> list[int]:
        """The blocks of a request's first shard (on its start rank), ``[]`` if none."""
        start = self._start.get(request_id)
        return [] if start is None else self.managers[start].block_table(request_id)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return sum(p.num_in_use for p in self.pools)

    def check_blocks(self) -> list[int]:
        """Blocks in use per rank, after each pool's integrity check (AssertionError)."""
        return [m.check_blocks()[0] for m in self.managers]

    def evict_all_cached(self) -> int:
        return sum(m.evict_all_cached() for m in self.managers)

    def drain_events(self) -> list[tuple[str, int]]:
        """Every rank's ``("stored" | "evicted", hash)`` events, rank by rank."""
        return [e for m in self.managers for e in m.drain_events()]

    def cached_hashes(self) -> list[int]:
        return sorted({h for m in self.managers for h in m.cached_hashes()})

    def likely_cached_blocks(self, hashes: list[int]) -> int:
        """The most leading ``hashes`` any one rank holds (by hash alone)."""
        return max(m.likely_cached_blocks(hashes) for m in self.managers)

    def free_blocks_per_rank(self) -> list[int]:
        return [p.num_free for p in self.pools]

    def blocks_per_rank(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Blocks ``seq``'s first ``num_tokens`` tokens occupy per rank: shard ``i`` (tokens
        ``[i * limit, (i + 1) * limit)``) on rank ``(start + i) % kvp``, ``start`` the rank
        it holds blocks from (or the one the balancer would pick now). Tokens past what
        the ranks hold together are not counted (``allocate`` refuses them)."""
        start = self._start.get(seq.request_id)
        if start is None:
            start = self._choose_start(seq)
        out = [0] * self.kvp
        tokens = min(max(num_tokens, 0), self.max_tokens)
        for i in range(-(-tokens // self.limit)):
            shard = min(tokens, (i + 1) * self.limit) - i * self.limit
            out[(start + i) % self.kvp] += -(-shard // self.block_size)
        return out

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def hit_ratio(self) -> float:
        queried = sum(m.queried_tokens for m in self.managers)
        return sum(m.hit_tokens for m in self.managers) / queried if queried else 0.0
