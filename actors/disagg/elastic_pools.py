"""A ``PDCluster``'s prefill and decode pools, each kept at its size: a scaled pool grows
and shrinks on its own signal (``policies.pool_scaling``), a fixed one stays at its
configured count; applied to its ``ReplicaSet`` at every Conductor poll.

- Signals, from the replicas' latest reports: a prefill replica's queued prefill tokens;
  a decode replica's KV use (blocks in use, pending or reserved, over its pool).
- Growing: ``ReplicaSet.begin_start`` (the new replica joins when it runs; the Conductor
  never waits on it), counted in the pool's size from the start.
- Shrinking drains: the replica with the least work is marked draining (the Conductor
  places nothing new on it); once nothing is bound to it (a prefill replica has finished
  its prefills, a decode replica its requests) it is retired. A draining replica is never
  killed with work on it, so no request is lost.
- A replica asked to leave (``leave``: an operator's drain request, which the replica
  passes on in its report) no longer counts in its pool's size, so a fixed pool starts a
  replacement at once (a scaled pool's scaler decides); it keeps taking work until
  another replica of its pool does (a pool is never left with none), then drains and is
  retired like any other.

``sizes()`` and ``decisions()`` feed ``/metrics`` (``PDCounters``); ``events`` records
every change: (when, pool, "leave" | "grow" | "drain" | "retire", replica id, signal,
need).
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.disagg.cluster_config import PDSideConfig
from actors.disagg.replica_set import ReplicaSet
from actors.disagg.request_table import RequestTable
from policies.autoscaling import ScalingDecision
from policies.pool_scaling import DECODE_POOL, PREFILL_POOL, PoolScaler


@dataclass(frozen=True)
class PoolEvent:
    time: float  # time.monotonic()
    pool: str
    action: str  # leave | grow | drain | retire
    replica_id: str
    signal: str
    need: float  # replicas the load needed at the target


class ElasticPools:
    def __init__(
        self,
        replicas: ReplicaSet,
        table: RequestTable,
        prefill: PDSideConfig,
        decode: PDSideConfig,
    ) -> None:
        """``prefill`` / ``decode``: each side's config; its ``scaling`` (None: the pool
        stays at ``count``)."""
        self.replicas, self.table = replicas, table
        sides = ((PREFILL_POOL, prefill), (DECODE_POOL, decode))
        self.scalers = {
            pool: PoolScaler(pool, side.scaling) for pool, side in sides if side.scaling is not None
        }
        self.fixed = {pool: side.count for pool, side in sides if side.scaling is None}
        self.leaving: set[str] = set()  # asked to leave, still taking work
        self.events: list[PoolEvent] = []

    def leave(self, rid: str, now: float) -> None:
        """Replica ``rid`` asked to leave its pool (once; asking again changes nothing)."""
        r = self.replicas
        known = rid in r.prefill_views or rid in r.decode_views
        if not known or rid in self.leaving or rid in r.draining:
            return
        self.leaving.add(rid)
        self._record(now, self._pool_of(rid), "leave", rid)

    def step(self, now: float) -> None:
        """Let started replicas join, retire drained ones, move each pool toward the size
        it should have, and drain the replicas that asked to leave once another replica of
        their pool takes work."""
        r = self.replicas
        r.poll_starting()
        for rid in sorted(r.draining):
            if self._idle(rid):
                r.retire(rid)
                self._record(now, self._pool_of(rid), "retire", rid)
        self.leaving &= set(r.prefill_views) | set(r.decode_views)  # retired meanwhile
        for pool in (PREFILL_POOL, DECODE_POOL):
            live = self._staying(pool)
            starting = [rid for rid in r.starting if rid[0] == pool[0]]
            size = len(live) + len(starting)
            scaler = self.scalers.get(pool)
            if scaler is None:
                wanted = self.fixed[pool]
            else:
                wanted = scaler.decide(self._signals(pool, live), size, now)
            for _ in range(wanted - size):
                self._record(now, pool, "grow", r.begin_start(pool))
            for _ in range(size - wanted):
                live = self._staying(pool)
                if len(live) <= 1:
                    break  # a pool keeps one replica that takes work
                rid = min(live, key=lambda x: self._work(pool, x))
                r.draining.add(rid)
                self._record(now, pool, "drain", rid)
            for rid in sorted(x for x in self.leaving if x[0] == pool[0]):
                if not self._staying(pool):
                    break  # it is the pool's last replica taking work: not yet
                self.leaving.discard(rid)
                r.draining.add(rid)
                self._record(now, pool, "drain", rid)

    def sizes(self) -> dict[str, int]:
        """Replicas per pool that take work and stay, or are starting (draining ones and
        ones asked to leave not counted)."""
        r = self.replicas
        return {
            pool: len(self._staying(pool)) + sum(1 for s in r.starting if s[0] == pool[0])
            for pool in (PREFILL_POOL, DECODE_POOL)
        }

    def decisions(self) -> dict[str, ScalingDecision]:
        """Each scaled pool's latest decision (its need and the signal behind it)."""
        return {p: s.last for p, s in self.scalers.items() if s.last is not None}

    # -- reading the replica set --------------------------------------------------------------
    def _accepting(self, pool: str) -> list[str]:
        r = self.replicas
        ids = r.prefill_views if pool == PREFILL_POOL else r.decode_views
        return [rid for rid in ids if r.accepting(rid)]

    def _staying(self, pool: str) -> list[str]:
        """Replicas of ``pool`` that take work and were not asked to leave."""
        return [rid for rid in self._accepting(pool) if rid not in self.leaving]

    def _signals(self, pool: str, ids: list[str]) -> list[float]:
        return [self._work(pool, rid) for rid in ids]

    def _work(self, pool: str, rid: str) -> float:
        r = self.replicas
        if pool == PREFILL_POOL:
            return float(r.prefill_views[rid].queued_tokens)
        v = r.decode_views[rid]
        return (v.used_blocks + v.pending_blocks) / v.total_blocks if v.total_blocks else 0.0

    def _idle(self, rid: str) -> bool:
        r = self.replicas
        if rid in r.prefill_views:
            return not self.table.in_prefill_on(rid) and r.prefill_views[rid].queued_tokens == 0
        v = r.decode_views[rid]
        bound = self.table.bound_to_decode(rid)
        return not bound and v.num_running == 0 and v.pending_blocks == 0

    @staticmethod
    def _pool_of(rid: str) -> str:
        return PREFILL_POOL if rid[0] == "p" else DECODE_POOL

    def _record(self, now: float, pool: str, action: str, rid: str) -> None:
        last = self.scalers[pool].last if pool in self.scalers else None
        signal, need = (last.signal, last.need) if last is not None else ("", 0.0)
        self.events.append(PoolEvent(now, pool, action, rid, signal, need))
