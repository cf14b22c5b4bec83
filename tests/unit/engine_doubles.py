"""What every engine double of the ``EngineLoop`` unit tests answers the same way: the
engine-protocol calls these tests do not exercise (idle release, shutdown, stats, prefix-
cache events)."""

from __future__ import annotations

import time

from policies.replica_stats import ReplicaStats


class QuietEngineParts:
    """Nothing to release when idle or on shutdown, one free sequence and block, no cached
    blocks and no cache events."""

    def on_idle(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def serving_stats(self) -> ReplicaStats:
        return ReplicaStats(0, 0, 0, 1, 1, 0.0, 0.0, time.time())

    def cached_block_hashes(self) -> list[int]:
        return []

    def drain_cache_events(self) -> list[tuple[str, int]]:
        return []
