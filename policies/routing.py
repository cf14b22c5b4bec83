"""Request routing across replicas: each policy ranks every replica, best first.

A router holds one ``ReplicaView`` per replica and asks a ``RoutingPolicy`` for a ranking;
the caller sends the request to the first replica that accepts it, falling back down the
list. Invariant of every ``rank``: it returns each given replica id exactly once.

Pure: no clock (``now`` is an argument), randomness comes from an injected
``random.Random``, and hashing uses ``hashlib`` (never Python's per-process salted
``hash()``) so every process and the simulator agree. ``policies.cluster_view`` keeps the
views current from stats snapshots and cache events, and from the router's own decisions.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from itertools import takewhile
from operator import itemgetter
from typing import Any, Protocol

from policies.registry import Registry

# A running request costs this many prefill-token equivalents in ``replica_load``: each
# running request takes one slot of every iteration's token budget until it finishes, so
# a replica with many running requests serves a newcomer's prefill more slowly.
DEFAULT_RUNNING_WEIGHT = 16.0


@dataclass(slots=True)
class ReplicaView:
    """What a router knows about one replica, refreshed from its stats."""

    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 1
    # Block hashes the replica holds. A ``ClusterView`` gives its views a read-only live
    # view of its index (``CachedBlocks``); change those only through the ClusterView.
    cached: Set[int] = field(default_factory=set)
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


class PrefixRankingPolicy(RoutingPolicy, Protocol):
    """A policy that can also rank from prefix lengths a caller measured (``PrefixAware``).
    ``ClusterView.route`` uses ``rank_with_prefix`` when a policy has it, measuring the
    lengths with its ``PrefixIndex`` instead of each view's set."""

    def rank_with_prefix(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        prefix_blocks: Sequence[int],
        now: float,
        cached_blocks: Sequence[int] | None = None,
    ) -> list[str]: ...


# Fields of ``PrefixAware``'s sort key
# ``(-counted prefix, not the session's replica, load, -prefix, cached, position)``.
_load_of = itemgetter(2)
_fallback_key = itemgetter(2, 0, 1, 3, 4, 5)  # load first: the order after an overload


def cached_prefix_blocks(block_hashes: Sequence[int], cached: Set[int]) -> int:
    """Number of leading blocks of ``block_hashes`` present in ``cached``.

    Hashes are chained, so block i is only useful if blocks 0..i-1 are: stop at the first miss.
    (``takewhile`` over the set's ``__contains__`` runs the walk in C.)
    """
    return len(list(takewhile(cached.__contains__, block_hashes)))


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
    """Longest useful cached prefix first, guarded against overload.

    A replica's cached prefix *counts* when it covers at least ``min_prefix_fraction`` of
    the request's full blocks (the default 0.1 is the match-rate threshold of Ray Serve
    LLM's prefix-aware router): a shared system prompt alone then does not pull every new
    conversation onto the few replicas that hold it. Normal order, by ascending key:

        ``(-counted prefix, not the session's replica, load, -prefix, cached blocks,
        position)``

    i.e. the longest counted prefix; then, for a request with a ``session_id`` (with
    ``session_affinity``), the session's replica: the one this policy ranked first for the
    session's last request, else the session's owner on a consistent-hash ring; then the
    least loaded; then the longest prefix even if it does not count; then the smallest
    cache footprint (spreads new prefixes, so no replica's cache churns while others sit
    empty); then the given order. So a session only breaks ties of the prefix match (or
    stands in when nothing matches); it is never a hard pin. The first of that order is
    the best holder. It is *overloaded* (only a best holder with a counted prefix or the
    session's replica can be) when both

        ``load(best) - min_load > max_imbalance``  and  ``load(best) > max_imbalance_ratio *
        min_load``

    (the ratio defaults to 1, i.e. only the absolute gap counts). Then the ranking falls
    back to the other replicas by ascending load (then the same keys), with the best
    holder last.

    ``rank`` measures each replica's prefix from its view's ``cached`` set (the walk stops at
    the first miss: O(replicas x matched blocks)); ``rank_with_prefix`` takes the lengths
    ready-made, e.g. from a ``PrefixIndex`` (``ClusterView.route`` does this), and
    optionally the cache sizes too, and gives the same ranking for the same inputs.
    """

    def __init__(
        self,
        max_imbalance: float = 4096.0,
        max_imbalance_ratio: float = 1.0,
        running_weight: float = DEFAULT_RUNNING_WEIGHT,
        min_prefix_fraction: float = 0.1,
        session_affinity: bool = True,
        max_sessions: int = 100_000,
    ) -> None:
        """``max_sessions``: sessions whose last replica is remembered (least recently
        routed forgotten first; a forgotten session falls back to its ring owner)."""
        if max_imbalance < 0 or max_imbalance_ratio < 1.0:
            raise ValueError("max_imbalance must be >= 0 and max_imbalance_ratio >= 1")
        if not 0.0 <= min_prefix_fraction <= 1.0:
            raise ValueError("min_prefix_fraction must be in [0, 1]")
        self.max_imbalance = max_imbalance
        self.max_imbalance_ratio = max_imbalance_ratio
        self.running_weight = running_weight
        self.min_prefix_fraction = min_prefix_fraction
        self.session_affinity = session_affinity
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> last first choice
        self._ring = ConsistentHash()

    def session_replica(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> str | None:
        """The replica a session's request leans to: its last first choice if still
        listed, else its ring owner; None without a session (or affinity)."""
        sid = request.session_id
        if sid is None or not self.session_affinity or not replicas:
            return None
        last = self._sessions.get(sid)
        if last is not None and any(r.replica_id == last for r in replicas):
            return last
        return self._ring.rank(request, replicas, 0.0)[0]

    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], now: float) -> list[str]:
        hashes = request.block_hashes
        prefix = [cached_prefix_blocks(hashes, r.cached) for r in replicas]
        return self.rank_with_prefix(request, replicas, prefix, now)

    def rank_with_prefix(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaView],
        prefix_blocks: Sequence[int],
        now: float,
        cached_blocks: Sequence[int] | None = None,
    ) -> list[str]:
        """The ranking, given ``prefix_blocks[k]``: the cached prefix of ``replicas[k]``,
        and optionally ``cached_blocks[k]``: ``len(replicas[k].cached)``, when the caller
        keeps those counts anyway (a ``ClusterView`` does)."""
        n = len(replicas)
        if n != len(prefix_blocks):
            raise ValueError("need one prefix length per replica")
        if not n:
            return []
        if cached_blocks is None:
            cached_blocks = [len(r.cached) for r in replicas]
        elif len(cached_blocks) != n:
            raise ValueError("need one cache size per replica")
        w = self.running_weight
        floor = self.min_prefix_fraction * len(request.block_hashes)
        lean = self.session_replica(request, replicas)
        # One tuple per replica, built in one pass: the sort key, position last. (The
        # lengths are checked above; ``zip`` without ``strict`` saves a check per step.)
        scored = sorted(
            [
                (
                    -p if p >= floor else 0,
                    r.replica_id != lean,
                    r.queued_prefill_tokens + w * r.num_running,
                    -p,
                    c,
                    k,
                )
                for k, r, p, c in zip(range(n), replicas, prefix_blocks, cached_blocks)  # noqa: B905
            ]
        )
        best = scored[0]
        # A best holder with neither a counted prefix nor the session is the least loaded:
        # never overloaded.
        if best[0] or not best[1]:
            best_load = best[2]
            min_load = min(map(_load_of, scored))
            if (
                best_load - min_load > self.max_imbalance
                and best_load > self.max_imbalance_ratio * min_load
            ):
                scored = sorted(scored[1:], key=_fallback_key)
                scored.append(best)
        ranking = [replicas[s[5]].replica_id for s in scored]
        if lean is not None and request.session_id is not None:
            sessions = self._sessions
            sessions[request.session_id] = ranking[0]
            sessions.move_to_end(request.session_id)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        return ranking


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


RoutingFactory = Callable[[random.Random, dict[str, Any]], RoutingPolicy]
ROUTING_POLICIES: Registry[RoutingFactory] = Registry("routing policy")
ROUTING_POLICIES.add("random", lambda rng, o: RandomRouting(rng, **o))
ROUTING_POLICIES.add("round_robin", lambda rng, o: RoundRobin(**o))
ROUTING_POLICIES.add("least_loaded", lambda rng, o: LeastLoaded(**o))
ROUTING_POLICIES.add("power_of_two", lambda rng, o: PowerOfTwoChoices(rng, **o))
ROUTING_POLICIES.add("prefix_aware", lambda rng, o: PrefixAware(**o))
ROUTING_POLICIES.add("consistent_hash", lambda rng, o: ConsistentHash(**o))


def routing_name(name: str) -> str:
    """``name`` as the table spells it: lower case, ``-`` read as ``_``."""
    return name.strip().lower().replace("-", "_")


def make_routing_policy(name: str, seed: int = 0, **options: Any) -> RoutingPolicy:
    """A fresh policy called ``name`` (see ``routing_name``), built with ``options``;
    randomized policies draw from ``Random(seed)``. Raises ValueError naming the choices for
    an unknown name, or the option a policy does not take."""
    key = routing_name(name)
    factory = ROUTING_POLICIES.get(key)
    try:
        return factory(random.Random(seed), dict(options))
    except TypeError as e:  # an option the policy's constructor does not take
        raise ValueError(f"bad options for routing policy {key!r}: {e}") from None
