"""The router's live picture of its replicas (``ClusterView``): the ``ReplicaView`` each
routing policy (``policies.routing``) ranks, kept current from stats snapshots, cache
events and the router's own decisions.

Pure: no clock (``now`` is an argument).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from policies.prefix_index import PrefixIndex
from policies.replica_stats import ReplicaStats
from policies.routing import ReplicaView, RouteRequest, RoutingPolicy


@dataclass(frozen=True)
class _Routed:
    """A request the router recorded on a replica before its stats could show it."""

    time: float
    tokens: int  # uncomputed prompt tokens
    new_blocks: int
    request_id: str
    added: tuple[int, ...]  # hashes the record added to the replica's cached set


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

    The cached hashes live once, in a ``PrefixIndex`` (hash -> replicas): each view's
    ``cached`` is that index's read-only live view of the replica (``CachedBlocks``), so
    ``route`` with a prefix policy costs one walk over the request's matched blocks, not
    one per replica, and recording a routed request writes each new hash once. Change a
    replica's hashes only through this class (``apply_events``, ``reset_cached``,
    ``on_routed``); never assign another set to a view's ``cached``.

    ``replicas`` returns the live view objects (no copies), in insertion order.
    """

    def __init__(self, block_size: int, pending_ttl: float = 5.0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.pending_ttl = pending_ttl
        self._views: dict[str, ReplicaView] = {}
        self._list: list[ReplicaView] = []
        self._bits: list[int] = []  # index bit of each view in ``_list``
        self._position_of_bit: dict[int, int] = {}  # index bit -> position in ``_list``
        self._slots: list[int] = []  # index slot of each view in ``_list``
        self._slots_in_order = True  # ``_slots == [0, 1, ..., n - 1]``
        self._all_bits = 0  # the OR of ``_bits``
        self._position: dict[str, int] = {}  # replica id -> its position in ``_list``
        self.index = PrefixIndex()
        # Per replica: the requests routed to it since its snapshot, oldest first.
        self._pending: dict[str, deque[_Routed]] = {}
        # request id -> (its replica, its record), routed within ``pending_ttl``, oldest first:
        # what ``on_moved`` takes back, whether or not a snapshot has absorbed its load
        self._recent: dict[str, tuple[str, _Routed]] = {}

    # -- membership ------------------------------------------------------------------------
    def add_replica(
        self, replica_id: str, total_blocks: int = 1, region: str = "default"
    ) -> ReplicaView:
        if replica_id in self._views:
            return self._views[replica_id]
        self.index.add_replica(replica_id)
        view = ReplicaView(
            replica_id,
            free_blocks=total_blocks,
            total_blocks=total_blocks,
            cached=self.index.cached(replica_id),
            region=region,
        )
        self._views[replica_id] = view
        self._pending[replica_id] = deque()
        self._relist()
        return view

    def remove_replica(self, replica_id: str) -> None:
        if self._views.pop(replica_id, None) is None:
            return
        self._pending.pop(replica_id, None)
        self._recent = {k: v for k, v in self._recent.items() if v[0] != replica_id}
        self.index.remove_replica(replica_id)
        self._relist()

    def _relist(self) -> None:
        self._list = list(self._views.values())
        self._slots = [self.index.slot(v.replica_id) for v in self._list]
        self._bits = [1 << slot for slot in self._slots]
        self._slots_in_order = self._slots == list(range(self.index.num_slots))
        self._position_of_bit = {b: k for k, b in enumerate(self._bits)}
        self._all_bits = sum(self._bits)
        self._position = {v.replica_id: k for k, v in enumerate(self._list)}

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
        stats: ReplicaStats,
        now: float,
        snapshot_time: float | None = None,
    ) -> None:
        """Apply a stats snapshot: it sets the view's counters (``num_running``,
        ``num_waiting``, ``queued_prefill_tokens``, ``free_blocks``, ``total_blocks``) and
        its region if given; ``kv_usage`` and ``cache_hit_ratio`` are for metrics only.

        ``snapshot_time`` (or ``stats.time``) is when the replica took it, on the router's
        clock. Routed requests newer than the snapshot are added back on top of it.
        """
        view = self._views.get(replica_id) or self.add_replica(replica_id)
        taken = snapshot_time if snapshot_time is not None else stats.time
        pending = self._pending[replica_id]
        while pending and (pending[0].time <= taken or pending[0].time < now - self.pending_ttl):
            pending.popleft()
        view.num_running = stats.num_running
        view.num_waiting = stats.num_waiting
        view.queued_prefill_tokens = stats.queued_prefill_tokens
        view.free_blocks = stats.free_blocks
        view.total_blocks = max(1, stats.total_blocks)
        if stats.region is not None:
            view.region = stats.region
        for r in pending:
            view.queued_prefill_tokens += r.tokens
            view.num_waiting += 1
            view.free_blocks = max(0, view.free_blocks - r.new_blocks)

    def apply_events(self, replica_id: str, events: Iterable[tuple[str, int]]) -> None:
        """Apply ``("stored" | "evicted", hash)`` events (``BlockPool.drain_events``) in order."""
        if replica_id not in self._views:
            self.add_replica(replica_id)
        self.index.apply_events(replica_id, events)

    def reset_cached(self, replica_id: str, hashes: Iterable[int]) -> None:
        """Replace a replica's cached set wholesale (a resync after lost events or a restart);
        the view keeps the same ``cached`` object."""
        if replica_id not in self._views:
            self.add_replica(replica_id)
        self.index.reset(replica_id, hashes)

    # -- the router's own decisions --------------------------------------------------------
    def on_routed(
        self, replica_id: str, request: RouteRequest, now: float, hit_blocks: int | None = None
    ) -> None:
        """Account for ``request`` sent to ``replica_id`` before any stats can show it.

        Uncomputed tokens = prompt tokens - cached prefix blocks x block_size (at least one
        token is always computed); new blocks = prompt blocks not already cached.
        ``hit_blocks`` is that cached prefix if the caller already measured it.
        """
        view = self._views[replica_id]
        hashes = request.block_hashes
        hit = hit_blocks if hit_blocks is not None else self.index.prefix_length(replica_id, hashes)
        tokens = max(1, request.num_prompt_tokens - hit * self.block_size)
        new_blocks = -(-request.num_prompt_tokens // self.block_size) - hit
        view.queued_prefill_tokens += tokens
        view.num_waiting += 1
        view.free_blocks = max(0, view.free_blocks - new_blocks)
        cached = view.cached
        added = [h for h in hashes[hit:] if h not in cached]
        self.index.add(replica_id, added)
        routed = _Routed(now, tokens, new_blocks, request.request_id, tuple(added))
        self._pending[replica_id].append(routed)
        recent = self._recent
        recent.pop(request.request_id, None)  # a new record goes last
        recent[request.request_id] = (replica_id, routed)
        while True:  # at least the record just added stays
            oldest = next(iter(recent))
            if recent[oldest][1].time >= now - self.pending_ttl:
                break
            del recent[oldest]

    def on_moved(
        self, request: RouteRequest, routed_to: str, runs_on: str | None, now: float
    ) -> None:
        """``request``, recorded on ``routed_to`` (its ranking's first), runs on ``runs_on``
        instead (the replica deployment placed it further down its ranking), or nowhere
        (None: refused, or its start failed).

        What ``on_routed`` recorded on ``routed_to`` is taken back: its load while no
        snapshot has absorbed it (a snapshot could not count a request the replica never
        got), and the hashes it added (only the replica's own events confirm hashes), if
        the correction comes within ``pending_ttl`` of the routing. The request is then
        recorded on ``runs_on``."""
        entry = self._recent.pop(request.request_id, None)
        if entry is not None and entry[0] == routed_to:
            self._take_back(routed_to, entry[1])
        if runs_on is not None and runs_on in self._views:
            self.on_routed(runs_on, request, now)

    def _take_back(self, replica_id: str, routed: _Routed) -> None:
        pending = self._pending[replica_id]
        for k, r in enumerate(pending):
            if r is routed:  # its load is still on the view
                del pending[k]
                view = self._views[replica_id]
                view.queued_prefill_tokens = max(0, view.queued_prefill_tokens - routed.tokens)
                view.num_waiting = max(0, view.num_waiting - 1)
                view.free_blocks = min(view.total_blocks, view.free_blocks + routed.new_blocks)
                break
        self.index.discard(replica_id, routed.added)

    def prefix_blocks(self, request: RouteRequest) -> list[int]:
        """Each replica's cached prefix of ``request``, in ``replicas`` order."""
        runs = self.index.runs(request.block_hashes)
        if not runs:
            return [0] * len(self._list)
        holders, end = runs[0]
        if holders == self._all_bits:  # e.g. a system prompt every replica holds
            out = [end] * len(self._bits)
        else:
            out = [end if holders & b else 0 for b in self._bits]
        position = self._position_of_bit
        for holders, end in runs[1:]:  # subsets of the first run: usually a bit or two
            while holders:
                low = holders & -holders
                out[position[low]] = end
                holders ^= low
        return out

    def route(self, policy: RoutingPolicy, request: RouteRequest, now: float) -> list[str]:
        """Rank with ``policy``, record the routing to the first choice, return the ranking.

        A policy with ``rank_with_prefix`` gets the prefix lengths from the index, and the
        cache sizes from the index's counts."""
        rank_with_prefix = getattr(policy, "rank_with_prefix", None)
        if rank_with_prefix is None:
            ranking = policy.rank(request, self._list, now)
            if ranking:
                self.on_routed(ranking[0], request, now)
            return ranking
        prefix = self.prefix_blocks(request)
        counts = self.index.counts
        # In slot order (no replica removed yet) the counts are already by position; the
        # policy only reads them during the call.
        sizes = counts if self._slots_in_order else list(map(counts.__getitem__, self._slots))
        ranking = rank_with_prefix(request, self._list, prefix, now, cached_blocks=sizes)
        if ranking:
            first = ranking[0]
            self.on_routed(first, request, now, prefix[self._position[first]])
        return ranking


# The one table of routing-policy names: the router (``actors.serving.router_state``), the
# deployment config's ``routing`` and the simulator (``sim.presets``) pick by these names.
# An entry builds a fresh policy from ``(rng, options)``: its constructor's keyword
# arguments; randomized policies draw from ``rng``.
