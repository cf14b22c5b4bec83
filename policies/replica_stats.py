"""One replica's stats snapshot: what every ``ServingEngine.serving_stats`` returns, what a
replica pushes to its router, and what ``ClusterView.update_stats`` applies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # uncomputed prompt tokens of waiting and running requests
    free_blocks: int
    total_blocks: int
    kv_usage: float  # blocks in use / total_blocks
    cache_hit_ratio: float  # prompt tokens served from the prefix cache, since start
    time: float  # when it was taken, on the router's clock (wall clock by default)
    region: str | None = None  # None: the router keeps the region it knows

    def counters(self) -> tuple[int, int, int, int, int]:
        """What changes when the replica's work changes (``time`` always does)."""
        return (
            self.num_running,
            self.num_waiting,
            self.queued_prefill_tokens,
            self.free_blocks,
            self.total_blocks,
        )
