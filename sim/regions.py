"""Several regions of colocated replicas with injected one-way delays between regions, behind
either one balancer per region (SkyWalker: ``policies.region_balancer``) or one global
balancer in the first region running a ``policies.routing`` policy (blind pushing).

Every request enters at its client's region (``region_of``). Latency model: a hop between
regions a and b costs ``delay[(a, b)]`` each way; inside a region it is free. TTFT is the
first token's arrival back at the client: the request's forward path plus the same path
back. (TBT is unaffected: every token pays the same return delay.)

SkyWalker mode: each balancer probes its replicas every ``probe_interval`` (pending =
waiting requests not yet admitted to the batch, read at once: same region) and its peers
(the probe reaches the peer after the one-way delay, which answers with its status then; the
answer arrives after another delay). A balancer learns of its own pushes' first tokens and
finishes at once (it proxies the stream). Global mode: the balancer sees every replica's
state exactly and at once (an idealised global view; the real one would be a delay old).

Closed loop (``follow``, e.g. ``sim.closed_loop.ClosedLoopClients.answered``): when a
request's answer (last token, or its refusal) reaches its client, ``follow(request id, that
time)`` returns the requests the client sends next; they arrive like the initial ones.

Invariants: every arrived request is placed on exactly one instance (a forwarded request
takes one extra hop, never two); probes stop once every request has finished and none is
still to come, so the event heap empties.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from functools import partial

from policies.region_balancer import BalancedRequest, BalancerConfig, Placement, RegionBalancer
from policies.routing import ReplicaView, RouteRequest, RoutingPolicy
from policies.sequence import Sequence
from policies.target_choice import CachedPrefixChoice
from sim.cluster import Arrival, ClusterBase, InstanceSpec
from sim.events import Event
from sim.instance import SimInstance
from sim.metrics import RequestStats
from sim.workload import TraceRequest

Delay = Mapping[tuple[str, str], float]


def one_way(delay: Delay, a: str, b: str) -> float:
    if a == b:
        return 0.0
    if (a, b) in delay:
        return delay[(a, b)]
    if (b, a) in delay:
        return delay[(b, a)]
    raise ValueError(f"no delay given between regions {a!r} and {b!r}")


class MultiRegionCluster(ClusterBase):
    def __init__(
        self,
        replicas: Mapping[str, int],  # region -> replicas, in region order
        spec: InstanceSpec,
        delay: Delay,
        region_of: Mapping[str, str],  # request id -> its client's region
        balancer: BalancerConfig | None = None,  # SkyWalker mode
        global_policy: RoutingPolicy | None = None,  # global mode
        probe_interval: float = 0.1,
        exact_local: bool = False,  # local view: the replicas' exact caches, not the trie
        follow: Callable[[str, float], Seq[TraceRequest]] | None = None,  # closed loop
    ) -> None:
        super().__init__()
        if (balancer is None) == (global_policy is None):
            raise ValueError("give exactly one of balancer (per region) or global_policy")
        if probe_interval <= 0:
            raise ValueError("probe_interval must be positive")
        self.block_size = spec.block_size
        self.regions = list(replicas)
        self.delay = delay
        self.region_of = region_of
        self.probe_interval = probe_interval
        self._instances: list[SimInstance] = []
        self.instance_region: dict[str, str] = {}
        for region, n in replicas.items():
            for i in range(n):
                inst = spec.build(f"{region}{i}", "colocated", self)
                inst.index = len(self._instances)
                self._instances.append(inst)
                self.instance_region[inst.instance_id] = region
        self._by_id = {inst.instance_id: inst for inst in self._instances}
        self._arrivals: dict[str, Arrival] = {}
        self._back: dict[str, float] = {}  # request id -> return delay to its client
        self._pusher: dict[str, RegionBalancer] = {}  # request id -> balancer that pushed it
        self._open = 0  # requests arrived or scheduled to arrive, not yet finished
        self._index = 0  # the next arrival's index (token_fn's unique id)
        self.follow = follow
        self.forwarded = 0
        self.balancers: dict[str, RegionBalancer] = {}
        self.global_policy = global_policy
        if balancer is not None:
            for region in self.regions:
                mine = [i for i in self._instances if self.instance_region[i.instance_id] == region]
                exact = CachedPrefixChoice({i.instance_id: i.cached for i in mine})
                lb = RegionBalancer(
                    f"lb-{region}", region, balancer, local_choice=exact if exact_local else None
                )
                for inst in mine:
                    lb.add_replica(inst.instance_id)
                self.balancers[region] = lb
            for region, lb in self.balancers.items():
                for other in self.regions:
                    if other != region:
                        lb.add_remote(f"lb-{other}", other)
            self._lb_by_name = {lb.name: lb for lb in self.balancers.values()}
        self.views = [
            ReplicaView(i.instance_id, total_blocks=i.pool.num_blocks, cached=i.cached)
            for i in self._instances
        ]

    def instances(self) -> list[SimInstance]:
        return self._instances

    def run(self, requests: Seq[TraceRequest], until: float = float("inf")) -> list[RequestStats]:
        self._open = len(requests)
        self._index = len(requests)
        if self.balancers and requests:
            start = min(r.arrival for r in requests)
            for lb in self.balancers.values():
                self.loop.push(Event(start, partial(self._probe, lb)))
        return super().run(requests, until)

    # -- arrivals --------------------------------------------------------------------------
    def dispatch(self, a: Arrival, now: float) -> list[Event]:
        rid = a.req.request_id
        origin = self.region_of[rid]
        if origin not in self.regions:
            raise ValueError(f"request {rid} comes from unknown region {origin!r}")
        self._arrivals[rid] = a
        self._back[rid] = 0.0
        if self.global_policy is not None:
            home = self.regions[0]
            d = one_way(self.delay, origin, home)
            self._back[rid] += d
            return [Event(now + d, partial(self._route_global, a))]
        lb = self.balancers[origin]
        req = BalancedRequest(rid, tuple(a.hashes), a.req.arrival, a.req.session_id, None, origin)
        lb.submit(req, now)
        return self._pump(lb, now)

    def _route_global(self, a: Arrival, now: float) -> list[Event]:
        assert self.global_policy is not None
        self._refresh()
        route = RouteRequest(a.req.request_id, a.hashes, a.req.input_len, a.req.session_id)
        inst = self._by_id[self.global_policy.rank(route, self.views, now)[0]]
        d = one_way(self.delay, self.regions[0], self.instance_region[inst.instance_id])
        self._back[a.req.request_id] += d
        return [Event(now + d, partial(self._submit, inst, a))]

    def _refresh(self) -> None:
        for inst, view in zip(self._instances, self.views, strict=True):
            sched = inst.scheduler
            view.num_running = sched.num_running
            view.num_waiting = sched.num_waiting
            view.queued_prefill_tokens = sched.queued_prefill_tokens()
            view.free_blocks = inst.pool.num_free

    def _submit(self, inst: SimInstance, a: Arrival, now: float) -> list[Event]:
        a.stats.prefill_instance = a.stats.decode_instance = inst.index
        return inst.submit(self.new_sequence(a, a.req.output_len), now)

    # -- SkyWalker balancers ---------------------------------------------------------------
    def _pump(self, lb: RegionBalancer, now: float) -> list[Event]:
        events: list[Event] = []
        for p in lb.dispatch(now):
            events += self._apply(lb, p, now)
        return events

    def _apply(self, lb: RegionBalancer, p: Placement, now: float) -> list[Event]:
        rid = p.request.request_id
        if p.kind == "local":
            self._pusher[rid] = lb
            return self._submit(self._by_id[p.target], self._arrivals[rid], now)
        self.forwarded += 1
        peer = self._lb_by_name[p.target]
        d = one_way(self.delay, lb.region, peer.region)
        self._back[rid] += d
        return [Event(now + d, partial(self._receive, peer, p.request))]

    def _receive(self, lb: RegionBalancer, req: BalancedRequest, now: float) -> list[Event]:
        lb.submit(req, now)
        return self._pump(lb, now)

    def _probe(self, lb: RegionBalancer, now: float) -> list[Event]:
        for rid in lb.replicas:
            lb.on_replica_probe(rid, self._by_id[rid].scheduler.num_waiting, now, now)
        events = self._pump(lb, now)
        for peer in self.balancers.values():
            if peer is not lb:
                d = one_way(self.delay, lb.region, peer.region)
                events.append(Event(now + d, partial(self._answer, lb, peer, now, d)))
        if self._open > 0:
            events.append(Event(now + self.probe_interval, partial(self._probe, lb)))
        return events

    def _answer(
        self, lb: RegionBalancer, peer: RegionBalancer, sent: float, d: float, now: float
    ) -> list[Event]:
        status = peer.status(now)

        def deliver(t: float) -> list[Event]:
            lb.on_remote_probe(peer.name, status, sent, t)
            return self._pump(lb, t)

        return [Event(now + d, deliver)]

    # -- InstanceListener ------------------------------------------------------------------
    def on_token(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        rid = seq.request_id
        st = self.stats[rid]
        first = st.first_token is None
        st.on_token(now + self._back[rid])
        lb = self._pusher.get(rid)
        if first and lb is not None:
            lb.on_prefilled(rid, now)
            self.loop.push(Event(now, partial(self._pump_event, lb)))

    def _pump_event(self, lb: RegionBalancer, now: float) -> list[Event]:
        return self._pump(lb, now)

    def _next_turns(self, rid: str, at_client: float) -> list[Event]:
        """Closed loop: the client's next requests, now that its answer reached it."""
        if self.follow is None:
            return []
        events = []
        for req in self.follow(rid, at_client):
            self._open += 1
            events.append(Event(req.arrival, partial(self._arrive, req, self._index)))
            self._index += 1
        return events

    def on_finished(self, inst: SimInstance, seq: Sequence, now: float) -> list[Event]:
        rid = seq.request_id
        st = self.stats[rid]
        st.cached_tokens = seq.num_cached_tokens
        st.on_finish(now + self._back[rid])
        events = self._next_turns(rid, now + self._back[rid])
        self._open -= 1
        lb = self._pusher.pop(rid, None)
        if lb is None:
            return events
        lb.on_finished(rid, now)
        return events + self._pump(lb, now)

    def on_unservable(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        super().on_unservable(inst, seq, now)
        for e in self._next_turns(seq.request_id, now + self._back[seq.request_id]):
            self.loop.push(e)
        self._open -= 1
        lb = self._pusher.pop(seq.request_id, None)
        if lb is not None:
            lb.on_finished(seq.request_id, now)
