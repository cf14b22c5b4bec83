"""What every simulated cluster shares: arrivals, per-request records, the event loop.

A cluster turns each ``TraceRequest`` into tokens and chained block hashes once (the real
``store.hashing``), then ``dispatch`` (the subclass: routing or the Conductor) places it.
Invariant: every arrived request gets exactly one ``RequestStats`` that ends either
finished (``on_finish``) or rejected (``on_reject``) by the time the event heap is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial

from placement.cost_model import CostModel
from policies.request import Request, SamplingParams
from policies.sequence import Sequence
from sim.events import Event, EventLoop
from sim.instance import SchedulingSpec, SimInstance
from sim.metrics import RequestStats
from sim.tokens import prompt_tokens
from sim.workload import TraceRequest
from store.hashing import chained_block_hashes


@dataclass
class InstanceSpec:
    """How to build one instance: its cost model and scheduler/KV settings."""

    cost: CostModel
    num_blocks: int
    block_size: int = 512
    token_budget: int = 8192
    max_num_seqs: int = 256
    chunk_size: int | None = None
    enable_prefix_caching: bool = True
    scheduling: SchedulingSpec | None = None  # None: FCFS with fixed chunks

    def build(self, instance_id: str, role: str, listener: ClusterBase) -> SimInstance:
        return SimInstance(
            instance_id,
            role,
            self.cost,
            self.num_blocks,
            self.block_size,
            listener,
            token_budget=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            chunk_size=self.chunk_size,
            enable_prefix_caching=self.enable_prefix_caching,
            loop=listener.loop,
            scheduling=self.scheduling,
        )


@dataclass
class Arrival:
    """A request at the door: its trace record, tokens, hashes and record."""

    req: TraceRequest
    tokens: list[int]
    hashes: list[int]
    stats: RequestStats


class ClusterBase:
    block_size: int = 512

    def __init__(self) -> None:
        self.loop = EventLoop()
        self.stats: dict[str, RequestStats] = {}
        # How a trace request becomes token ids (replaceable, e.g. to match a live replay).
        self.token_fn: Callable[[TraceRequest, int], list[int]] = prompt_tokens

    # -- the run -------------------------------------------------------------------------
    def run(self, requests: Seq[TraceRequest], until: float = float("inf")) -> list[RequestStats]:
        for i, r in enumerate(requests):
            self.loop.push(Event(r.arrival, partial(self._arrive, r, i)))
        self.loop.run(until)
        return list(self.stats.values())

    def _arrive(self, req: TraceRequest, index: int, now: float) -> list[Event]:
        if req.request_id in self.stats:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        st = RequestStats(req.request_id, req.arrival, req.input_len, req.output_len)
        self.stats[req.request_id] = st
        tokens = self.token_fn(req, index)
        hashes = chained_block_hashes(tokens, self.block_size)
        return self.dispatch(Arrival(req, tokens, hashes, st), now)

    def dispatch(self, a: Arrival, now: float) -> list[Event]:
        raise NotImplementedError

    def new_sequence(self, a: Arrival, max_tokens: int) -> Sequence:
        """The arrival as the request record the live engine takes (its hashes, computed
        once at arrival, are extended by the KV manager, never recomputed)."""
        request = Request(
            a.req.request_id,
            a.tokens,
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            0,
            self.block_size,
            a.hashes,
            arrival_time=a.req.arrival,
        )
        return Sequence.from_request(request)

    # -- InstanceListener ----------------------------------------------------------------
    def on_token(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        self.stats[seq.request_id].on_token(now)

    def on_finished(self, inst: SimInstance, seq: Sequence, now: float) -> list[Event]:
        st = self.stats[seq.request_id]
        st.cached_tokens = seq.num_cached_tokens
        st.on_finish(now)
        return []

    def on_unservable(self, inst: SimInstance, seq: Sequence, now: float) -> None:
        self.stats[seq.request_id].on_reject("too_long", now)

    # -- observation ---------------------------------------------------------------------
    def instances(self) -> list[SimInstance]:
        raise NotImplementedError

    def check_integrity(self) -> None:
        for inst in self.instances():
            inst.pool.check_integrity()
            assert inst.cached == set(inst.pool._by_hash), (
                f"{inst.instance_id}: cache mirror drifted"
            )
