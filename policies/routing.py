"""Request routing across replicas: each policy ranks every replica, best first.

A router holds one ``ReplicaView`` per replica and asks a ``RoutingPolicy`` for a ranking;
the caller sends the request to the first replica that accepts it, falling back down the
list. Invariant of every ``rank``: it returns each given replica id exactly once.

Pure: no clock (``now`` is an argument), randomness comes from an injected
``random.Random``, and hashing uses ``hashlib`` (never Python's per-process salted
``hash()``) so every process and the simulator agree. ``ClusterView`` keeps the views
current from stats snapshots and cache events, and from the router's own decisions.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# A running request costs this many prefill-token equivalents in ``replica_load``: each
# running request takes one slot of every iteration's token budget until it finishes, so
# a replica with many running requests serves a newcomer's prefill more slowly.
DEFAULT_RUNNING_WEIGHT = 16.0


@dataclass
class ReplicaView:
    """What a router knows about one replica, refreshed from its stats."""

    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 1
    cached: set[int] = field(default_factory=set)  # block hashes the replica holds
    region: str = "default"


@dataclass
class RouteRequest:
    request_id: str
    block_hashes: list[int]  # chained hashes of the prompt's full blocks
    num_prompt_tokens: int
    session_id: str | None = None


class RoutingPolicy(Protocol):
    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        """Replica ids, best first; every replica appears exactly once."""
        ...


def cached_prefix_blocks(block_hashes: Sequence[int], cached: set[int] | frozenset[int]) -> int:
    """Number of leading blocks of ``block_hashes`` present in ``cached``.

    Hashes are chained, so block i is only useful if blocks 0..i-1 are: stop at the first miss.
    """
    n = 0
    for h in block_hashes:
        if h not in cached:
            break
        n += 1
    return n


def replica_load(view: ReplicaView, running_weight: float = DEFAULT_RUNNING_WEIGHT) -> float:
    """Load in prefill-token equivalents:

    ``load = queued_prefill_tokens + running_weight * num_running``

    ``queued_prefill_tokens`` already counts the waiting requests' uncomputed prompts, so
    ``num_waiting`` is not added again.
    """
    return view.queued_prefill_tokens + running_weight * view.num_running


def _check_distinct(replicas: Sequence[ReplicaView]) -> None:
    if len({r.replica_id for r in replicas}) != len(replicas):
        raise ValueError("replica ids must be distinct")


class RandomRouting:
    """A uniformly random permutation."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        ids = [r.replica_id for r in replicas]
        self.rng.shuffle(ids)
        return ids


class RoundRobin:
    """The i-th call ranks the replicas rotated to start at position ``i mod n``."""

    def __init__(self) -> None:
        self._next = 0

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        ids = [r.replica_id for r in replicas]
        if not ids:
            return []
        start = self._next % len(ids)
        self._next = start + 1
        return ids[start:] + ids[:start]


class LeastLoaded:
    """Ascending ``replica_load``; ties keep the given replica order (the sort is stable)."""

    def __init__(self, running_weight: float = DEFAULT_RUNNING_WEIGHT) -> None:
        self.running_weight = running_weight

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        w = self.running_weight
        return [r.replica_id for r in sorted(replicas, key=lambda r: replica_load(r, w))]


class PowerOfTwoChoices:
    """Sample two distinct replicas; the less loaded of the two is first, the other second
    (ties keep the sample order), then the rest by ascending load as fallbacks."""

    def __init__(self, rng: random.Random, running_weight: float = DEFAULT_RUNNING_WEIGHT) -> None:
        self.rng = rng
        self.running_weight = running_weight

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        if len(replicas) <= 1:
            return [r.replica_id for r in replicas]
        w = self.running_weight
        i, j = self.rng.sample(range(len(replicas)), 2)
        a, b = replicas[i], replicas[j]
        if replica_load(b, w) < replica_load(a, w):
            a, b = b, a
        rest = sorted(
            (r for k, r in enumerate(replicas) if k != i and k != j),
            key=lambda r: replica_load(r, w),
        )
        return [a.replica_id, b.replica_id] + [r.replica_id for r in rest]


class PrefixAware:
    """Longest cached prefix first, guarded against overload.

    Normal order: descending cached prefix blocks, ties by ascending load. The best holder
    is the first of that order. It is *overloaded* when both

        ``load(best) - min_load > max_imbalance``  and  ``load(best) > max_imbalance_ratio *
        min_load``

    (the ratio defaults to 1, i.e. only the absolute gap counts). Then the ranking falls
    back to the other replicas by ascending load (ties by longer prefix), with the best
    holder last. The walk over each replica's prefix stops at its first miss and reads the
    cached sets in place, so a call costs O(replicas x matched blocks + replicas log replicas).
    """

    def __init__(
        self,
        max_imbalance: float = 4096.0,
        max_imbalance_ratio: float = 1.0,
        running_weight: float = DEFAULT_RUNNING_WEIGHT,
    ) -> None:
        if max_imbalance < 0 or max_imbalance_ratio < 1.0:
            raise ValueError("max_imbalance must be >= 0 and max_imbalance_ratio >= 1")
        self.max_imbalance = max_imbalance
        self.max_imbalance_ratio = max_imbalance_ratio
        self.running_weight = running_weight

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        if not replicas:
            return []
        w = self.running_weight
        hashes = request.block_hashes
        # (-prefix blocks, load, position, id): the position keeps ties in the given order.
        scored = [
            (-cached_prefix_blocks(hashes, r.cached), replica_load(r, w), k, r.replica_id)
            for k, r in enumerate(replicas)
        ]
        scored.sort()
        best_load = scored[0][1]
        min_load = min(s[1] for s in scored)
        overloaded = (
            best_load - min_load > self.max_imbalance
            and best_load > self.max_imbalance_ratio * min_load
        )
        if not overloaded:
            return [s[3] for s in scored]
        rest = sorted(scored[1:], key=lambda s: (s[1], s[0], s[2]))
        return [s[3] for s in rest] + [scored[0][3]]


def _ring_point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


class ConsistentHash:
    """A hash ring with ``virtual_nodes`` points per replica (blake2b of ``"id#i"``).

    The key is the session id, else the first block hash, else the request id. The ranking
    walks the ring clockwise from the key's point and lists replicas in order of first
    appearance, so the first entry is the classic owner and the rest are the fallbacks a
    ring would use if the owner were skipped (SkyWalker-CH). Removing a replica deletes only
    its points: keys it owned move to their next replica; every other key keeps its owner.
    The ring is rebuilt only when the set of replica ids changes.
    """

    def __init__(self, virtual_nodes: int = 100) -> None:
        if virtual_nodes <= 0:
            raise ValueError("virtual_nodes must be positive")
        self.virtual_nodes = virtual_nodes
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # owner of each position

    def _build(self, ids: frozenset[str]) -> None:
        ring = sorted(
            (_ring_point(f"{rid}#{i}"), rid) for rid in ids for i in range(self.virtual_nodes)
        )
        self._members = ids
        self._points = [p for p, _ in ring]
        self._owners = [rid for _, rid in ring]

    @staticmethod
    def key_of(request: RouteRequest) -> str:
        if request.session_id is not None:
            return "s:" + request.session_id
        if request.block_hashes:
            return "b:" + str(request.block_hashes[0])
        return "r:" + request.request_id

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        _check_distinct(replicas)
        ids = frozenset(r.replica_id for r in replicas)
        if not ids:
            return []
        if ids != self._members:
            self._build(ids)
        start = bisect.bisect_left(self._points, _ring_point(self.key_of(request)))
        order: list[str] = []
        seen: set[str] = set()
        n = len(self._points)
        for k in range(n):
            rid = self._owners[(start + k) % n]
            if rid not in seen:
                seen.add(rid)
                order.append(rid)
                if len(order) == len(ids):
                    break
        return order


class ClusterView:
    """The router's live picture of its replicas.

    Two sources feed it. Stats snapshots (``update_stats``) set the counters; they are
    0.5-1.5 s stale, so the view also applies its own decisions at once (``on_routed``): the
    routed request's hashes join the chosen replica's ``cached`` set and its uncomputed
    prompt tokens join the queue. Invariant: a replica's ``queued_prefill_tokens`` and
    ``num_waiting`` equal the last snapshot plus every request routed to it after that
    snapshot was taken (and within ``pending_ttl`` seconds), so a snapshot never erases a
    decision it could not have seen. Cache events (``apply_events``) keep ``cached`` exact
    up to hashes added optimistically for requests that never stored them; those leave
    with the replica's evicted events or a full ``reset_cached``.

    ``replicas`` returns the live view objects (no copies), in insertion order.
    """

    def __init__(self, block_size: int, pending_ttl: float = 5.0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.pending_ttl = pending_ttl
        self._views: dict[str, ReplicaView] = {}
        self._list: list[ReplicaView] = []
        # Per replica: (route time, uncomputed tokens, new blocks) routed since its snapshot.
        self._pending: dict[str, deque[tuple[float, int, int]]] = {}

    # -- membership ------------------------------------------------------------------------
    def add_replica(
        self, replica_id: str, total_blocks: int = 1, region: str = "default"
    ) -> ReplicaView:
        if replica_id in self._views:
            return self._views[replica_id]
        view = ReplicaView(
            replica_id, free_blocks=total_blocks, total_blocks=total_blocks, region=region
        )
        self._views[replica_id] = view
        self._pending[replica_id] = deque()
        self._list = list(self._views.values())
        return view

    def remove_replica(self, replica_id: str) -> None:
        self._views.pop(replica_id, None)
        self._pending.pop(replica_id, None)
        self._list = list(self._views.values())

    def replica(self, replica_id: str) -> ReplicaView:
        return self._views[replica_id]

    @property
    def replicas(self) -> list[ReplicaView]:
        return self._list

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._views

    def __len__(self) -> int:
        return len(self._views)

    # -- inputs from replicas --------------------------------------------------------------
    def update_stats(
        self,
        replica_id: str,
        stats: Mapping[str, Any],
        now: float,
        snapshot_time: float | None = None,
    ) -> None:
        """Apply a stats snapshot whose keys are ``ReplicaView`` counter names
        (``num_running``, ``num_waiting``, ``queued_prefill_tokens``, ``free_blocks``,
        ``total_blocks``, optionally ``region``; missing keys keep their value).

        ``snapshot_time`` (or ``stats["time"]``) is when the replica took it, on the
        router's clock; without one the snapshot counts as taken ``now``. Routed requests
        newer than the snapshot are added back on top of it.
        """
        view = self._views.get(replica_id) or self.add_replica(replica_id)
        taken = snapshot_time if snapshot_time is not None else stats.get("time", now)
        pending = self._pending[replica_id]
        while pending and (pending[0][0] <= taken or pending[0][0] < now - self.pending_ttl):
            pending.popleft()
        for name in ("num_running", "num_waiting", "queued_prefill_tokens", "free_blocks"):
            if name in stats:
                setattr(view, name, int(stats[name]))
        if "total_blocks" in stats:
            view.total_blocks = max(1, int(stats["total_blocks"]))
        if "region" in stats:
            view.region = str(stats["region"])
        for _, tokens, blocks in pending:
            view.queued_prefill_tokens += tokens
            view.num_waiting += 1
            view.free_blocks = max(0, view.free_blocks - blocks)

    def apply_events(self, replica_id: str, events: Iterable[tuple[str, int]]) -> None:
        """Apply ``("stored" | "evicted", hash)`` events (``BlockPool.drain_events``) in order."""
        cached = (self._views.get(replica_id) or self.add_replica(replica_id)).cached
        for kind, h in events:
            if kind == "stored":
                cached.add(h)
            elif kind == "evicted":
                cached.discard(h)
            else:
                raise ValueError(f"unknown cache event {kind!r}")

    def reset_cached(self, replica_id: str, hashes: Iterable[int]) -> None:
        """Replace a replica's cached set wholesale (a resync after lost events or a restart)."""
        view = self._views.get(replica_id) or self.add_replica(replica_id)
        view.cached.clear()
        view.cached.update(hashes)

    # -- the router's own decisions --------------------------------------------------------
    def on_routed(self, replica_id: str, request: RouteRequest, now: float) -> None:
        """Account for ``request`` sent to ``replica_id`` before any stats can show it.

        Uncomputed tokens = prompt tokens - cached prefix blocks x block_size (at least one
        token is always computed); new blocks = prompt blocks not already cached.
        """
        view = self._views[replica_id]
        hit = cached_prefix_blocks(request.block_hashes, view.cached)
        tokens = max(1, request.num_prompt_tokens - hit * self.block_size)
        new_blocks = -(-request.num_prompt_tokens // self.block_size) - hit
        view.queued_prefill_tokens += tokens
        view.num_waiting += 1
        view.free_blocks = max(0, view.free_blocks - new_blocks)
        view.cached.update(request.block_hashes)
        self._pending[replica_id].append((now, tokens, new_blocks))

    def route(self, policy: RoutingPolicy, request: RouteRequest, now: float) -> list[str]:
        """Rank with ``policy``, record the routing to the first choice, return the ranking."""
        ranking = policy.rank(request, self._list, now)
        if ranking:
            self.on_routed(ranking[0], request, now)
        return ranking
