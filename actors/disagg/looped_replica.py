"""What prefill and decode replicas share: a replica controller that only its own loop
thread touches (``ReplicaLoop``), the stats that thread publishes after every iteration,
and the Conductor's long poll."""

from __future__ import annotations

from actors.disagg.messages import DecodeStats, PrefillStats, Report
from actors.engine.replica_controller import ReplicaController
from actors.engine.replica_loop import ReplicaLoop


class LoopedReplica:
    replica_id: str
    controller: ReplicaController
    loop: ReplicaLoop
    stats: PrefillStats | DecodeStats  # replaced (never mutated) by the loop thread

    def ping(self) -> str:
        return self.replica_id

    def report(self, timeout: float) -> Report:
        """The Conductor's long poll: events since the last report (waiting up to
        ``timeout`` s for one), then the replica's state. Raises once the loop failed."""
        events = self.loop.take(timeout)
        if self.loop.error is not None:
            raise RuntimeError(f"replica {self.replica_id} failed") from self.loop.error
        return Report(self.replica_id, events, self.stats)

    def report_stats(self) -> PrefillStats | DecodeStats:
        return self.stats

    def check_blocks(self) -> int:
        """Blocks in use (0 when idle), after the KV manager's integrity check."""

        def check() -> int:
            return sum(self.controller.kv.check_blocks())

        return int(self.loop.call(check).result())
