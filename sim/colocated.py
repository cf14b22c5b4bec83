"""Colocated replicas (a vLLM-like baseline): each instance prefills and decodes, with
chunked prefill under one token budget, behind a router running a real routing policy.

The router's view is exact and current (the simulator can read every replica at the instant
of routing), built as ``policies.routing.ReplicaView`` objects that share each instance's
live ``cached`` set; the policy's first choice gets the request. No admission control: a
request is rejected only when it cannot fit in an empty instance.
"""

from __future__ import annotations

from policies.routing import ReplicaView, RouteRequest, RoutingPolicy
from sim.cluster import Arrival, ClusterBase, InstanceSpec
from sim.events import Event
from sim.instance import SimInstance


class ColocatedCluster(ClusterBase):
    def __init__(self, num_instances: int, spec: InstanceSpec, policy: RoutingPolicy) -> None:
        super().__init__()
        if num_instances <= 0:
            raise ValueError("need at least one instance")
        self.block_size = spec.block_size
        self.policy = policy
        self._instances = [spec.build(f"c{i}", "colocated", self) for i in range(num_instances)]
        self._by_id = {inst.instance_id: inst for inst in self._instances}
        self.views = [
            ReplicaView(inst.instance_id, total_blocks=inst.pool.num_blocks, cached=inst.cached)
            for inst in self._instances
        ]
        # Views are refreshed only for instances that changed since the last arrival.
        self._dirty: set[int] = set(range(num_instances))
        for k, inst in enumerate(self._instances):
            inst.index, inst.watch = k, self._dirty

    def instances(self) -> list[SimInstance]:
        return self._instances

    def _refresh(self) -> None:
        for k in self._dirty:
            inst, view = self._instances[k], self.views[k]
            sched = inst.scheduler
            view.num_running = sched.num_running
            view.num_waiting = sched.num_waiting
            view.queued_prefill_tokens = sched.queued_prefill_tokens()
            view.free_blocks = inst.pool.num_free
        self._dirty.clear()

    def dispatch(self, a: Arrival, now: float) -> list[Event]:
        self._refresh()
        route = RouteRequest(a.req.request_id, a.hashes, a.req.input_len, a.req.session_id)
        ranking = self.policy.rank(route, self.views, now)
        inst = self._by_id[ranking[0]]
        a.stats.prefill_instance = a.stats.decode_instance = inst.index
        return inst.submit(self.new_sequence(a, a.req.output_len), now)
