"""What prefill and decode replicas share: a replica controller that only its own loop
thread touches (``ReplicaLoop``), the stats that thread publishes after every iteration,
and the Conductor's long poll; in its own actor process, every thread at nice 0.

A replica serves one Conductor at a time, the last that claimed it (``claim``, or ``reset``
when it attaches to a shared pool's replica): only that one's long poll takes the events,
another's raises ``Superseded``. Two Conductors of one pool can run at once (Serve starts
a replacement while an unhealthy one drains), and a report taken by the one that did not
place the request would drop its tokens."""

from __future__ import annotations

import ray

from actors.disagg.messages import DecodeStats, PrefillStats, Report
from actors.engine.replica_controller import ReplicaController
from actors.engine.replica_loop import ReplicaLoop
from actors.engine.thread_priority import run_process_at_normal_priority


def run_actor_process_at_normal_priority() -> None:
    """In a replica's own actor process, every thread at nice 0 (``thread_priority``), as
    in the Serve app's replica processes: besides the engine thread, the Conductor's long
    poll and Ray's reply threads carry every KV handoff and request end (and the tokens of
    requests without a ``ReturnRoute``), and at Ray's worker niceness they wait behind any
    nice-0 thread on the node. A replica built in its caller's process (tests) leaves that
    process's threads as they are."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        run_process_at_normal_priority()


class LoopedReplica:
    replica_id: str
    controller: ReplicaController
    loop: ReplicaLoop
    stats: PrefillStats | DecodeStats  # replaced (never mutated) by the loop thread
    leaving = False  # asked to leave its pool (``drain``); never set back
    weight_loads = 0  # weight updates loaded since its start (each version once)

    def ping(self) -> str:
        return self.replica_id

    def drain(self) -> None:
        """Ask to leave the pool (an operator scaling it down, or this replica's node about
        to go): every report from now on says so, and the Conductor drains the replica
        (nothing new placed on it once another replica of its pool takes work, what it
        holds runs to the end) and then retires it (``ElasticPools``). A pool of fixed
        size starts a replacement at once."""
        self.leaving = True

    def claim(self, owner: str) -> Report:
        """Conductor ``owner`` serves this replica from now on: the reports of any other
        raise ``Superseded``. Returns the replica's state (events left unread dropped)."""
        self.loop.claim(owner)
        return self._report(0.0, owner)

    @ray.method(enable_task_events=False)  # the hottest call: no record in the GCS
    def report(self, timeout: float, owner: str | None = None) -> Report:
        """The long poll of Conductor ``owner``: events since the last report (waiting up
        to ``timeout`` s for one), then the replica's state. Raises once the loop failed,
        and ``Superseded`` when another Conductor claimed the replica."""
        return self._report(timeout, owner)

    def _report(self, timeout: float, owner: str | None) -> Report:
        events = self.loop.take(timeout, owner)
        if self.loop.error is not None:
            raise RuntimeError(f"replica {self.replica_id} failed") from self.loop.error
        return Report(self.replica_id, events, self.stats, self.leaving)

    def weight_version(self) -> int:
        """The weight version the replica runs."""
        return int(self.controller.weight_version)

    def loads(self) -> int:
        """Weight updates loaded since its start (a Conductor that attaches to it loads
        none it runs already)."""
        return self.weight_loads

    def report_stats(self) -> PrefillStats | DecodeStats:
        return self.stats

    def update_weights(self, weights: list[object], version: int) -> int:
        """Load ``weights[0]`` (a list, so an object ref in it reaches the controller as a
        ref) as weight version ``version``, on the loop thread; the replica holds no
        request (its cluster holds none). Returns the bytes received."""
        (source,) = weights
        got = int(self.loop.call(lambda: self.controller.update_weights(source, version)).result())
        self.weight_loads += 1
        return got

    def sleep(self, level: int) -> int:
        """Free the KV cache (level 1) and the weights too (level 2), on the loop thread,
        holding no request. Returns the bytes freed."""
        return int(self.loop.call(lambda: self.controller.sleep(level)).result())

    def wake_up(self) -> None:
        self.loop.call(self.controller.wake_up).result()

    def check_blocks(self) -> int:
        """Blocks in use (0 when idle), after the KV manager's integrity check."""

        def check() -> int:
            return sum(self.controller.kv.check_blocks())

        return int(self.loop.call(check).result())
