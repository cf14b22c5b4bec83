"""Prefill and decode pools (Mooncake): the real Conductor picks a (prefill, decode) pair
or rejects; a prefill instance computes the prompt and the first token; the KV then moves
to the decode instance, which produces the rest.

A request's life: arrival -> [Conductor or a routing policy] -> (optional prefix copy from
another prefill instance: ``transfer_from``) -> prefill scheduler (``max_tokens=1``: the
step that completes the prompt samples the first token) -> KV streamed layer by layer over
the NIC, so only its unhidden tail (``stream_tail``) follows the prefill ->
decode scheduler (a new ``Sequence`` whose prompt is the old prompt plus the first token,
with every prompt token already computed, so it is admitted straight into decode and the
KV manager allocates its blocks: that allocation is the transfer landing).

Admission modes: the Conductor's ``none`` / ``early`` / ``predictive``, plus ``baseline``:
each pool judges its own load when the request reaches it (TTFT at arrival; decode's TBT
only after prefill, so a refused request has already spent its prefill).
Invariant: a decode instance's view counts, as ``pending`` / ``pending_blocks``, the
requests assigned to it whose KV has not landed yet (in prefill or in transfer) and their
lifetime blocks, and as ``num_running`` / ``used_blocks`` those decoding there now and
their lifetime blocks (``fresh_decode_view`` recomputes both from the pending records).
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.conductor import (
    Conductor,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
    finish_decode,
    start_decode,
)
from policies.routing import ReplicaView, RouteRequest, RoutingPolicy
from policies.sequence import Sequence
from sim.cluster import Arrival, ClusterBase, InstanceSpec
from sim.events import Event
from sim.instance import DUMMY_TOKEN, SimInstance
from sim.kv_copy import copy_prefix

ADMISSIONS = ("none", "early", "predictive", "baseline")


@dataclass
class _Pending:
    """A request between arrival and the end of its decode."""

    arrival: Arrival
    decode: SimInstance | None
    lifetime_blocks: int
    expected_cached: int = 0  # prompt tokens the decision expects cached on the prefill side
    landed: bool = False  # its KV reached the decode instance (it is decoding there)


class DisaggregatedCluster(ClusterBase):
    def __init__(
        self,
        num_prefill: int,
        num_decode: int,
        prefill_spec: InstanceSpec,
        decode_spec: InstanceSpec,
        conductor: Conductor,
        kv_bytes_per_token: int,
        nic_bandwidth: float = 87e9,  # Mooncake: 87 GB/s measured over 4 x 200 Gbps
        prefill_policy: RoutingPolicy | None = None,
        baseline_admission: bool = False,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        if prefill_spec.block_size != decode_spec.block_size:
            raise ValueError("prefill and decode block sizes must match")
        self.block_size = prefill_spec.block_size
        self.conductor = conductor
        self.prefill_policy = prefill_policy
        self.baseline_admission = baseline_admission
        self.kv_bytes_per_token = kv_bytes_per_token
        self.nic_bandwidth = nic_bandwidth
        self.num_layers = max(1, num_layers)
        self.prefill_cost = prefill_spec.cost
        self.prefills = [prefill_spec.build(f"p{i}", "prefill", self) for i in range(num_prefill)]
        decode_spec.enable_prefix_caching = False  # decode serves no prefix hits
        self.decodes = [decode_spec.build(f"d{i}", "decode", self) for i in range(num_decode)]
        self._by_id = {i.instance_id: i for i in self.prefills + self.decodes}
        for k, inst in enumerate(self.prefills):
            inst.index = k
        for k, inst in enumerate(self.decodes):
            inst.index = k
        self.pending: dict[str, _Pending] = {}
        self.inbound: dict[str, list[tuple[int, int]]] = {p.instance_id: [] for p in self.prefills}
        self.rejections: dict[str, int] = {}
        self.blocks_copied = 0
        self.views = [
            ReplicaView(p.instance_id, total_blocks=p.pool.num_blocks, cached=p.cached)
            for p in self.prefills
        ]
        # The views the Conductor reads are kept, not rebuilt per arrival: a prefill view is
        # refreshed only when its instance changed since the last arrival (``_dirty``, fed by
        # the instances' ``watch``); a decode view changes as requests are assigned, land
        # and finish (``_reserve`` / ``_land`` / ``_release``).
        # Each shares its instance's live ``cached`` set (no copies).
        self._pviews = [PrefillInstance(p.instance_id, cached=p.cached) for p in self.prefills]
        self._dviews = [
            DecodeInstance(d.instance_id, total_blocks=d.pool.num_blocks) for d in self.decodes
        ]
        self._dirty: set[int] = set(range(num_prefill))
        for p in self.prefills:
            p.watch = self._dirty

    def instances(self) -> list[SimInstance]:
        return self.prefills + self.decodes

    # -- what the Conductor sees --------------------------------------------------------------
    def transfer_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.nic_bandwidth

    def _queue_time(self, p: SimInstance) -> float:
        """Predicted prefill time of everything queued on ``p`` (Algorithm 1's T_queue)."""
        cost = self.prefill_cost
        t = 0.0
        for seq in p.scheduler.waiting + p.scheduler.running:
            pend = self.pending.get(seq.request_id)
            done = seq.num_computed_tokens or (pend.expected_cached if pend else 0)
            t += cost.batch_time([(seq.num_tokens - done, done)])
        for new, cached in self.inbound[p.instance_id]:
            t += cost.batch_time([(new, cached)])
        return t

    def stream_tail(self, prompt: int, cached: int) -> float:
        """Seconds from the end of prefill until the prompt's KV has landed on decode.

        Layer-wise streaming (Mooncake section 3.2.3/5.4.3): each layer's KV leaves as soon
        as the layer is computed, so the transfer of ``T = transfer_time(prompt)`` runs
        alongside the prefill's own ``P`` seconds (the cost model's time for the uncached
        part, a request alone). What is left at the end is the part the NIC could not hide,
        ``max(0, T - P)``, plus the last layer's share ``T / num_layers``."""
        t = self.transfer_time(prompt)
        p = self.prefill_cost.batch_time([(prompt - cached, cached)])
        return max(0.0, t - p) + t / self.num_layers

    def fresh_prefill_view(self, p: SimInstance) -> PrefillInstance:
        """A prefill view computed from scratch (what the kept views must always equal)."""
        return PrefillInstance(
            p.instance_id,
            queued_tokens=p.scheduler.queued_prefill_tokens()
            + sum(n for n, _ in self.inbound[p.instance_id]),
            cached=p.cached,
            queue_time=self._queue_time(p),
        )

    def _prefill_views(self) -> list[PrefillInstance]:
        if self._dirty:
            for k in self._dirty:
                p, view = self.prefills[k], self._pviews[k]
                fresh = self.fresh_prefill_view(p)
                view.queued_tokens, view.queue_time = fresh.queued_tokens, fresh.queue_time
                rv = self.views[k]
                rv.num_running = p.scheduler.num_running
                rv.num_waiting = p.scheduler.num_waiting
                rv.queued_prefill_tokens = fresh.queued_tokens
                rv.free_blocks = p.pool.num_free
            self._dirty.clear()
        return self._pviews

    def _decode_views(self) -> list[DecodeInstance]:
        return self._dviews

    def fresh_decode_view(self, d: SimInstance) -> DecodeInstance:
        """A decode view computed from the pending records (what the kept ones must equal)."""
        v = DecodeInstance(d.instance_id, total_blocks=d.pool.num_blocks)
        for pend in self.pending.values():
            if pend.decode is not d:
                continue
            if pend.landed:
                v.num_running += 1
                v.used_blocks += pend.lifetime_blocks
            else:
                v.pending += 1
                v.pending_blocks += pend.lifetime_blocks
        return v

    def _reserve(self, pend: _Pending) -> None:
        assert pend.decode is not None
        view = self._dviews[pend.decode.index]
        view.pending += 1
        view.pending_blocks += pend.lifetime_blocks

    def _land(self, pend: _Pending) -> None:
        assert pend.decode is not None and not pend.landed
        start_decode(self._dviews[pend.decode.index], pend.lifetime_blocks)
        pend.landed = True

    def _release(self, pend: _Pending) -> None:
        """Drop ``pend``'s share of its decode view, wherever it is in its life."""
        if pend.decode is None:
            return
        view = self._dviews[pend.decode.index]
        if pend.landed:
            finish_decode(view, pend.lifetime_blocks)
        else:
            view.pending -= 1
            view.pending_blocks -= pend.lifetime_blocks

    # -- arrival ------------------------------------------------------------------------------
    def _reject(self, a: Arrival, reason: str, now: float) -> list[Event]:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1
        a.stats.on_reject(reason, now)
        return []

    def dispatch(self, a: Arrival, now: float) -> list[Event]:
        req = ConductorRequest(
            a.req.request_id, a.hashes, a.req.input_len, a.req.output_len, self.block_size
        )
        prefill_views = self._prefill_views()
        if self.prefill_policy is not None:
            return self._dispatch_routed(a, req, prefill_views, now)
        decision = self.conductor.schedule(req, prefill_views, self._decode_views(), now)
        if not decision.accepted:
            return self._reject(a, decision.reason, now)
        if self.baseline_admission and decision.predicted_ttft > self.conductor.ttft_slo:
            return self._reject(a, "ttft_slo", now)
        p = self._by_id[decision.prefill_id or ""]
        d = None if self.baseline_admission else self._by_id[decision.decode_id or ""]
        cached = min(decision.cached_blocks * self.block_size, a.req.input_len - 1)
        events = self._replicate(decision.replicate_from, p, a, decision.replicate_blocks, now)
        if decision.transfer_from is None:
            return events + self._admit(a, req, p, d, cached, now)
        src = self._by_id[decision.transfer_from]
        delay = self.transfer_time(decision.cached_blocks * self.block_size)
        copy = (src, decision.cached_blocks)
        return events + self._admit(a, req, p, d, cached, now, delay, copy)

    def _dispatch_routed(
        self, a: Arrival, req: ConductorRequest, prefill_views: list[PrefillInstance], now: float
    ) -> list[Event]:
        """Prefill by a routing policy (random, load-balancing ...); decode by the Conductor's
        own decode selection (lowest predicted TBT with room); no SLO admission."""
        assert self.prefill_policy is not None  # self.views were refreshed with prefill_views
        route = RouteRequest(a.req.request_id, a.hashes, a.req.input_len, a.req.session_id)
        p = self._by_id[self.prefill_policy.rank(route, self.views, now)[0]]
        dec = self.conductor.select_decode(req, self._decode_views(), now)
        if dec is None:
            return self._reject(a, "decode_full", now)
        return self._admit(a, req, p, self.decodes[dec.index], 0, now)

    def _admit(
        self,
        a: Arrival,
        req: ConductorRequest,
        p: SimInstance,
        d: SimInstance | None,
        expected_cached: int,
        now: float,
        delay: float = 0.0,
        copy: tuple[SimInstance, int] | None = None,
    ) -> list[Event]:
        """Reserve decode space and hand the prompt to prefill, after ``delay`` when a prefix
        is first copied from ``copy = (source instance, blocks)``."""
        lifetime = Conductor.decode_blocks(req)
        pend = _Pending(a, d, lifetime, expected_cached)
        self.pending[a.req.request_id] = pend
        if d is not None:
            self._reserve(pend)
        a.stats.prefill_instance = p.index
        seq = self.new_sequence(a, 1)  # prefill yields exactly the first token
        if delay <= 0 and copy is None:
            return p.submit(seq, now)
        inbound = (a.req.input_len - expected_cached, expected_cached)
        self.inbound[p.instance_id].append(inbound)
        self._dirty.add(p.index)

        def land(t: float) -> list[Event]:
            self.inbound[p.instance_id].remove(inbound)
            self._dirty.add(p.index)
            if copy is not None:
                src, n = copy
                self.blocks_copied += copy_prefix(src.pool, p.pool, a.hashes, a.tokens, n)
                p.sync_cache()
            return p.submit(seq, t)

        return [Event(now + delay, land)]

    def _replicate(
        self, src_id: str | None, dst: SimInstance, a: Arrival, blocks: list[int], now: float
    ) -> list[Event]:
        """Hot-block replication, a side effect the request does not wait for."""
        if src_id is None or not blocks:
            return []
        src = self._by_id[src_id]
        upto = a.hashes.index(blocks[-1]) + 1 if blocks[-1] in a.hashes else 0

        def land(t: float) -> list[Event]:
            self.blocks_copied += copy_prefix(src.pool, dst.pool, a.hashes, a.tokens, upto)
            dst.sync_cache()
            self._dirty.add(dst.index)
            return []

        return [Event(now + self.transfer_time(len(blocks) * self.block_size), land)]

    # -- InstanceListener -------------------------------------------------------------------
    def on_finished(self, inst: SimInstance, seq: Sequence, now: float) -> list[Event]:
        pend = self.pending[seq.request_id]
        st = pend.arrival.stats
        if inst.role == "decode":
            return self._decode_done(pend, now)
        st.cached_tokens = seq.num_cached_tokens
        if st.output_len <= 1:
            return self._decode_done(pend, now)
        if pend.decode is None:  # baseline: decode judges its own load only now
            req = ConductorRequest(
                st.request_id, pend.arrival.hashes, st.input_len, st.output_len, self.block_size
            )
            dec = self.conductor.select_decode(req, self._decode_views(), now)
            if dec is None or dec.tbt > self.conductor.tbt_slo:
                del self.pending[seq.request_id]
                return self._reject(pend.arrival, "tbt_slo_after_prefill", now)
            pend.decode = self.decodes[dec.index]
            self._reserve(pend)
        d = pend.decode
        st.decode_instance = d.index
        tokens = pend.arrival.tokens + [DUMMY_TOKEN]
        dseq = Sequence(st.request_id, tokens, st.output_len - 1, arrival_time=st.arrival)
        dseq.block_hashes = list(pend.arrival.hashes)  # a prefix of the hashes of ``tokens``
        dseq.num_computed_tokens = len(tokens) - 1  # the prompt's KV arrives from prefill
        pend.arrival.tokens = []  # the prefill side is done with them
        arrive = now + self.stream_tail(st.input_len, st.cached_tokens)

        def land(t: float) -> list[Event]:
            self._land(pend)
            return d.submit(dseq, t)

        return [Event(arrive, land)]

    def _decode_done(self, pend: _Pending, now: float) -> list[Event]:
        st = pend.arrival.stats
        del self.pending[st.request_id]
        self._release(pend)
        st.on_finish(now)
        return []

    def on_unservable(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        pend = self.pending.pop(seq.request_id)
        self._release(pend)
        self._reject(pend.arrival, "too_long", now)
