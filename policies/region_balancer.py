"""One region's balancer: a FCFS queue, selective pushing to local replicas, cross-region
forwarding to peer balancers (SkyWalker sections 3.1-3.3, Algorithm 1 HandleRequest).

``submit`` queues a request; ``dispatch(now)`` places queued requests from the head, in
arrival order, until the head cannot be placed:

1. local first: if any local replica is available (``policies.availability``), the head goes
   to the one ``TargetChoice`` picks (longest recorded prefix, or the session's ring owner);
2. else, if forwarding is on and the request was never forwarded, it goes to the available
   peer balancer (free replicas, short queue) that the tenant's residency policy allows,
   picked by the snapshot trie of what this balancer forwarded to each peer (or the ring);
3. else the head waits (FCFS: nothing behind it overtakes), until a probe or a finish frees
   a target.

Invariants: a request is placed at most once per balancer; a placement of kind "forward"
carries ``forwarded=True`` and a forwarded request is only ever placed locally (never
forwarded again); every local push is counted by the availability rule at once (optimistic),
so two requests never go to one free replica between probes.

Push modes: "selective" (pending requests, SP-P), "cap" (fixed outstanding cap, SP-O),
"immediate" (blind pushing: every replica always available, so nothing is forwarded and
nothing waits while the region has a replica).

Pure: stdlib only, ``now`` is an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from policies.availability import (
    AlwaysAvailable,
    OutstandingCap,
    PendingAvailability,
    RemoteAvailability,
)
from policies.residency import ResidencyPolicy
from policies.target_choice import SessionHashChoice, TargetChoice, TrieChoice

PUSH_MODES = ("selective", "immediate", "cap")
CHOICES = ("trie", "hash")


@dataclass(frozen=True)
class BalancedRequest:
    request_id: str
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    arrival: float
    session_id: str | None = None
    tenant: str | None = None
    origin: str = ""  # the region whose balancer the client entered at
    forwarded: bool = False  # a balancer forwarded it once; it is never forwarded again


@dataclass(frozen=True)
class Placement:
    request: BalancedRequest
    target: str  # a local replica id, or a peer balancer id
    kind: str  # "local" | "forward"
    matched_blocks: int  # the chosen target's recorded prefix of the request


@dataclass(frozen=True)
class BalancerConfig:
    push: str = "selective"
    choice: str = "trie"
    max_pending: int = 1  # selective: available while fewer requests than this are pending
    outstanding_cap: int = 4  # cap: pushed, unfinished requests per replica
    remote_max_queue: int = 2  # tau: a peer with a longer queue is not available
    forward: bool = True
    trie_entries: int = 100_000
    push_ttl: float = 10.0  # an unconfirmed push stops counting after this long

    def __post_init__(self) -> None:
        if self.push not in PUSH_MODES:
            raise ValueError(f"push must be one of {PUSH_MODES}, not {self.push!r}")
        if self.choice not in CHOICES:
            raise ValueError(f"choice must be one of {CHOICES}, not {self.choice!r}")


@dataclass(frozen=True)
class BalancerStatus:
    """What a peer's probe gets back (Algorithm 1 line 10)."""

    free_replicas: int
    queue_len: int


def _make_choice(cfg: BalancerConfig) -> TargetChoice:
    return TrieChoice(cfg.trie_entries) if cfg.choice == "trie" else SessionHashChoice()


class RegionBalancer:
    def __init__(
        self,
        name: str,
        region: str,
        config: BalancerConfig | None = None,
        residency: ResidencyPolicy | None = None,
        local_choice: TargetChoice | None = None,  # default: by ``config.choice``
    ) -> None:
        self.name = name
        self.region = region
        self.config = cfg = config or BalancerConfig()
        self.residency = residency or ResidencyPolicy()
        if cfg.push == "selective":
            self.local: PendingAvailability | OutstandingCap | AlwaysAvailable = (
                PendingAvailability(cfg.max_pending, cfg.push_ttl)
            )
        elif cfg.push == "cap":
            self.local = OutstandingCap(cfg.outstanding_cap)
        else:
            self.local = AlwaysAvailable()
        self.remotes = RemoteAvailability(cfg.remote_max_queue, cfg.push_ttl)
        self.local_choice = local_choice or _make_choice(cfg)
        self.snapshot_choice = _make_choice(cfg)  # targets: peer balancers
        self.remote_region: dict[str, str] = {}
        self.outstanding: dict[str, int] = {}  # replica -> pushed, unfinished
        self._where: dict[str, str] = {}  # request id -> replica it was pushed to
        self.queue: deque[BalancedRequest] = deque()
        self.placed_local = 0
        self.forwarded = 0

    # -- membership ------------------------------------------------------------------------
    def add_replica(self, replica_id: str) -> None:
        self.local.add(replica_id)
        self.outstanding.setdefault(replica_id, 0)

    def remove_replica(self, replica_id: str) -> None:
        self.local.remove(replica_id)
        self.outstanding.pop(replica_id, None)
        self.local_choice.forget(replica_id)

    @property
    def replicas(self) -> list[str]:
        return self.local.targets

    def add_remote(self, balancer: str, region: str) -> None:
        self.remotes.add(balancer)
        self.remote_region[balancer] = region

    def remove_remote(self, balancer: str) -> None:
        self.remotes.remove(balancer)
        self.remote_region.pop(balancer, None)
        self.snapshot_choice.forget(balancer)

    # -- inputs ----------------------------------------------------------------------------
    def submit(self, request: BalancedRequest, now: float) -> None:
        self.queue.append(request)

    def on_replica_probe(self, replica_id: str, pending: int, sent_at: float, now: float) -> None:
        self.local.on_probe(replica_id, pending, sent_at, now)

    def on_remote_probe(
        self, balancer: str, status: BalancerStatus, sent_at: float, now: float
    ) -> None:
        self.remotes.on_probe(balancer, status.free_replicas, status.queue_len, sent_at, now)

    def on_prefilled(self, request_id: str, now: float) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            self.local.on_prefilled(replica, request_id, now)

    def on_finished(self, request_id: str, now: float) -> None:
        replica = self._where.pop(request_id, None)
        if replica is None:
            return
        self.local.on_finished(replica, request_id, now)
        if replica in self.outstanding:
            self.outstanding[replica] = max(0, self.outstanding[replica] - 1)

    def status(self, now: float) -> BalancerStatus:
        return BalancerStatus(len(self.local.available_set(now)), len(self.queue))

    # -- decisions -------------------------------------------------------------------------
    def _available_local(self, now: float) -> list[str]:
        free = self.local.available_set(now)
        return [r for r in self.local.targets if r in free]

    def remote_candidates(self, request: BalancedRequest, now: float) -> list[str]:
        """Peers this request may be forwarded to now: forwarding on, never forwarded before,
        peer available, its region allowed for the tenant."""
        if not self.config.forward or request.forwarded:
            return []
        free = self.remotes.available_set(now)
        return [
            b
            for b in self.remotes.balancers
            if b in free and self.residency.allowed(request.tenant, self.remote_region[b])
        ]

    def place_head(self, now: float) -> Placement | None:
        """Place the queue's head, or None (it stays at the head)."""
        if not self.queue:
            return None
        req = self.queue[0]
        local = self._available_local(now)
        if local:
            picked = self.local_choice.choose(
                req.block_hashes,
                req.session_id,
                req.request_id,
                local,
                self.local.targets,
                self.outstanding,
            )
            assert picked is not None
            target, matched = picked
            self.queue.popleft()
            self.local_choice.record(req.block_hashes, target)
            self.local.on_push(target, req.request_id, now)
            self.outstanding[target] += 1
            self._where[req.request_id] = target
            self.placed_local += 1
            return Placement(req, target, "local", matched)
        remote = self.remote_candidates(req, now)
        picked = self.snapshot_choice.choose(
            req.block_hashes, req.session_id, req.request_id, remote, self.remotes.balancers, {}
        )
        if picked is None:
            return None
        target, matched = picked
        self.queue.popleft()
        self.snapshot_choice.record(req.block_hashes, target)
        self.remotes.on_forward(target, req.request_id, now)
        self.forwarded += 1
        return Placement(replace(req, forwarded=True), target, "forward", matched)

    def dispatch(self, now: float) -> list[Placement]:
        out: list[Placement] = []
        while True:
            p = self.place_head(now)
            if p is None:
                return out
            out.append(p)

    def drain(self) -> list[BalancedRequest]:
        """Take every queued request out (a balancer handing its queue over)."""
        out = list(self.queue)
        self.queue.clear()
        return out


def nearest_alive(
    region: str, alive: Sequence[tuple[str, str]], delay: Mapping[tuple[str, str], float]
) -> str | None:
    """The balancer among ``alive`` ((balancer, region) pairs) nearest to ``region`` by
    one-way ``delay[(a, b)]`` (missing pairs count as infinitely far; same region is 0);
    ties go to the given order. None when no balancer is alive."""
    best: tuple[float, int, str] | None = None
    for k, (b, r) in enumerate(alive):
        d = 0.0 if r == region else delay.get((region, r), delay.get((r, region), float("inf")))
        if best is None or (d, k) < best[:2]:
            best = (d, k, b)
    return best[2] if best else None
