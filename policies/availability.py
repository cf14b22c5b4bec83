"""Which targets can take one more request now (SkyWalker section 3.3, Algorithm 1 lines 1-16).

A balancer probes its replicas and its peer balancers every probe interval (100 ms by
default). Between probes it counts its own pushes optimistically, so two requests never land
on one free replica between two probes.

- ``PendingAvailability`` (selective pushing by pending requests, SP-P): a replica is
  *available* when it has no pending request, i.e. none that is queued and not yet admitted
  to its continuous batch (not yet prefilled). Invariant: ``pending(r)`` is the last probe's
  count plus every push to ``r`` sent after that probe was sent and not yet seen prefilled
  (``on_prefilled``) nor older than ``push_ttl``. ``available(r)`` iff ``pending(r) <
  max_pending`` (1 by default: no pending request at all).
- ``OutstandingCap`` (selective pushing by a fixed outstanding cap, SP-O): available iff the
  balancer's own count of pushed, unfinished requests is below ``cap``.
- ``RemoteAvailability``: a peer balancer is available when its last probe showed at least
  one free replica and a queue no longer than ``max_queue`` (the paper's tau). Forwards sent
  after the probe each use up one of its free replicas until the next probe.

Pure: stdlib only, ``now`` is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _ReplicaState:
    probed_pending: int = 1  # unknown until the first probe: not available
    probe_sent: float = float("-inf")
    # request id -> push time, pushes the last probe could not have seen yet
    inflight: dict[str, float] = field(default_factory=dict)


class PendingAvailability:
    def __init__(self, max_pending: int = 1, push_ttl: float = 10.0) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.max_pending = max_pending
        self.push_ttl = push_ttl
        self._state: dict[str, _ReplicaState] = {}

    def add(self, target: str) -> None:
        self._state.setdefault(target, _ReplicaState())

    def remove(self, target: str) -> None:
        self._state.pop(target, None)

    @property
    def targets(self) -> list[str]:
        return list(self._state)

    def on_probe(self, target: str, pending: int, sent_at: float, now: float) -> None:
        """A probe sent at ``sent_at`` found ``pending`` requests waiting at ``target``.
        Pushes sent before the probe are in that count (or already prefilled): drop them."""
        st = self._state.get(target)
        if st is None:
            return
        st.probed_pending = max(0, pending)
        st.probe_sent = sent_at
        st.inflight = {
            rid: t for rid, t in st.inflight.items() if t > sent_at and t >= now - self.push_ttl
        }

    def on_push(self, target: str, request_id: str, now: float) -> None:
        st = self._state.get(target)
        if st is not None:
            st.inflight[request_id] = now

    def on_prefilled(self, target: str, request_id: str, now: float) -> None:
        """The balancer saw ``request_id``'s first token: it is no longer pending."""
        st = self._state.get(target)
        if st is not None:
            st.inflight.pop(request_id, None)

    def on_finished(self, target: str, request_id: str, now: float) -> None:
        self.on_prefilled(target, request_id, now)

    def pending(self, target: str, now: float) -> int:
        st = self._state[target]
        live = sum(1 for t in st.inflight.values() if t >= now - self.push_ttl)
        return st.probed_pending + live

    def available(self, target: str, now: float) -> bool:
        return target in self._state and self.pending(target, now) < self.max_pending

    def available_set(self, now: float) -> set[str]:
        return {t for t in self._state if self.pending(t, now) < self.max_pending}


class OutstandingCap:
    """Selective pushing by a fixed cap on outstanding (pushed, unfinished) requests."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self.cap = cap
        self._outstanding: dict[str, set[str]] = {}

    def add(self, target: str) -> None:
        self._outstanding.setdefault(target, set())

    def remove(self, target: str) -> None:
        self._outstanding.pop(target, None)

    @property
    def targets(self) -> list[str]:
        return list(self._outstanding)

    def on_probe(self, target: str, pending: int, sent_at: float, now: float) -> None:
        """Probes carry nothing this rule uses."""

    def on_push(self, target: str, request_id: str, now: float) -> None:
        if target in self._outstanding:
            self._outstanding[target].add(request_id)

    def on_prefilled(self, target: str, request_id: str, now: float) -> None:
        """Still outstanding until it finishes."""

    def on_finished(self, target: str, request_id: str, now: float) -> None:
        if target in self._outstanding:
            self._outstanding[target].discard(request_id)

    def pending(self, target: str, now: float) -> int:
        return len(self._outstanding[target])

    def available(self, target: str, now: float) -> bool:
        return target in self._outstanding and len(self._outstanding[target]) < self.cap

    def available_set(self, now: float) -> set[str]:
        return {t for t, out in self._outstanding.items() if len(out) < self.cap}


class AlwaysAvailable:
    """Immediate (blind) pushing: every known target takes every request at once."""

    def __init__(self) -> None:
        self._targets: dict[str, None] = {}

    def add(self, target: str) -> None:
        self._targets[target] = None

    def remove(self, target: str) -> None:
        self._targets.pop(target, None)

    @property
    def targets(self) -> list[str]:
        return list(self._targets)

    def on_probe(self, target: str, pending: int, sent_at: float, now: float) -> None:
        pass

    def on_push(self, target: str, request_id: str, now: float) -> None:
        pass

    def on_prefilled(self, target: str, request_id: str, now: float) -> None:
        pass

    def on_finished(self, target: str, request_id: str, now: float) -> None:
        pass

    def pending(self, target: str, now: float) -> int:
        return 0

    def available(self, target: str, now: float) -> bool:
        return target in self._targets

    def available_set(self, now: float) -> set[str]:
        return set(self._targets)


@dataclass
class _RemoteState:
    free_replicas: int = 0  # unknown until the first probe: not available
    queue_len: int = 0
    probe_sent: float = float("-inf")
    forwards: dict[str, float] = field(default_factory=dict)  # sent after the probe


class RemoteAvailability:
    def __init__(self, max_queue: int = 2, forward_ttl: float = 10.0) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self.forward_ttl = forward_ttl
        self._state: dict[str, _RemoteState] = {}

    def add(self, balancer: str) -> None:
        self._state.setdefault(balancer, _RemoteState())

    def remove(self, balancer: str) -> None:
        self._state.pop(balancer, None)

    @property
    def balancers(self) -> list[str]:
        return list(self._state)

    def on_probe(
        self, balancer: str, free_replicas: int, queue_len: int, sent_at: float, now: float
    ) -> None:
        st = self._state.get(balancer)
        if st is None:
            return
        st.free_replicas = max(0, free_replicas)
        st.queue_len = max(0, queue_len)
        st.probe_sent = sent_at
        st.forwards = {
            r: t for r, t in st.forwards.items() if t > sent_at and t >= now - self.forward_ttl
        }

    def on_forward(self, balancer: str, request_id: str, now: float) -> None:
        st = self._state.get(balancer)
        if st is not None:
            st.forwards[request_id] = now

    def free_replicas(self, balancer: str, now: float) -> int:
        """Free replicas at the last probe, less the forwards sent since."""
        st = self._state[balancer]
        live = sum(1 for t in st.forwards.values() if t >= now - self.forward_ttl)
        return max(0, st.free_replicas - live)

    def available(self, balancer: str, now: float) -> bool:
        st = self._state.get(balancer)
        if st is None:
            return False
        return self.free_replicas(balancer, now) > 0 and st.queue_len <= self.max_queue

    def available_set(self, now: float) -> set[str]:
        return {b for b in self._state if self.available(b, now)}
