"""One simulated serving instance: the real scheduler over the real block pool, timed by a
cost model instead of a GPU.

Each iteration: ``Scheduler.schedule(start)`` picks the batch; the cost model says how long
it runs (with sequence pipelining, ``spp > 1``, a step whose outputs nobody waits for, prompt
chunks that sample no token, holds the instance only for its ``stage_time``: the next chunk
enters as it leaves the first stage; any other step for its whole latency); at ``start +
duration`` ``Scheduler.update`` advances it with a dummy sampled token (0; sequences carry
no stop tokens, so they run to ``max_tokens``). Invariants: at most one
iteration is in flight per instance (``busy``); ``cached`` mirrors exactly the hashes the
pool holds (kept in step from the pool's stored/evicted events after every change).

Iterations run in place: when the next iteration of this instance would end before any
other queued event (strictly before, so same-time events keep their scheduling order), it
is simulated at once inside the same action instead of going through the heap; the
scheduler still runs ``schedule``/``update`` once per iteration and the loop's clock and
event count advance as if the event had been queued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from placement.cost_model import CostModel
from placement.runtime_predictor import RuntimePredictor
from policies.batch_packer import BatchPacker
from policies.chunking import FixedChunk
from policies.ordering import Ordering
from policies.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from policies.sequence import FinishReason, Sequence
from policies.slack import Deadlines, make_ordering
from sim.events import Event, EventLoop
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager

DUMMY_TOKEN = 0


@dataclass(frozen=True)
class SchedulingSpec:
    """An instance's prefill scheduling, as ``EngineConfig``'s options of the same names:
    the ordering (``policies.slack``) and, with ``target_batch_time``, Medha's batch packer;
    both predict with the instance's own cost model (the roofline standing in for the GPU,
    through a ``RuntimePredictor`` that never refits)."""

    scheduling: str = "fcfs"
    target_batch_time: float | None = None
    max_prefill_share: float = 0.5
    ttft_slo_factor: float = 3.0
    min_ttft_slo: float = 0.0

    def build(
        self, cost: CostModel, chunk_size: int | None
    ) -> tuple[Ordering | None, BatchPacker | None]:
        if self.scheduling == "fcfs" and self.target_batch_time is None:
            return None, None
        pred = RuntimePredictor(prior=cost, chunk_size=chunk_size or 4096)  # never observes
        ordering: Ordering | None = None
        if self.scheduling != "fcfs":
            stages = getattr(cost, "spp", 1)  # a prompt's chunks pipeline through them
            deadlines = Deadlines(pred, None, self.ttft_slo_factor, self.min_ttft_slo, stages)
            ordering = make_ordering(self.scheduling, deadlines)
        packer = None
        if self.target_batch_time is not None:
            packer = BatchPacker(
                pred, self.target_batch_time, self.max_prefill_share, max_chunk=chunk_size
            )
        return ordering, packer


class InstanceListener(Protocol):
    def on_token(self, inst: SimInstance, seq: Sequence, now: float) -> None: ...

    def on_finished(self, inst: SimInstance, seq: Sequence, now: float) -> list[Event]: ...

    def on_unservable(self, inst: SimInstance, seq: Sequence, now: float) -> None: ...


class SimInstance:
    def __init__(
        self,
        instance_id: str,
        role: str,  # "colocated" | "prefill" | "decode"
        cost: CostModel,
        num_blocks: int,
        block_size: int,
        listener: InstanceListener,
        token_budget: int = 8192,
        max_num_seqs: int = 256,
        chunk_size: int | None = None,
        prefill_beside_decodes: int | None = None,  # the engine's cap; None: the budget
        enable_prefix_caching: bool = True,
        loop: EventLoop | None = None,
        scheduling: SchedulingSpec | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.cost = cost
        self.listener = listener
        self.pool = BlockPool(num_blocks, block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=enable_prefix_caching)
        ordering, packer = (scheduling or SchedulingSpec()).build(cost, chunk_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                token_budget=token_budget,
                max_num_seqs=max_num_seqs,
                prefill_beside_decodes=prefill_beside_decodes,
            ),
            self.kv,
            ordering=ordering,
            chunk_rule=FixedChunk(chunk_size),
            packer=packer,
        )
        self.cached: set[int] = set()
        spp = getattr(cost, "spp", 1)
        self._stage_time = getattr(cost, "stage_time", None) if spp > 1 else None
        self.busy = False
        self.busy_time = 0.0
        self.iterations = 0
        self.prefill_tokens = 0  # tokens computed in prefill (not decode) steps
        self.peak_batch = 0  # most requests in one iteration
        self.peak_blocks = 0  # most KV blocks in use at an iteration's start
        self.loop = loop  # when given, iterations may run in place (see the module docstring)
        # Position in its pool, and an optional set the instance adds it to whenever its
        # scheduler state may have changed (clusters refresh only those views).
        self.index = 0
        self.watch: set[int] | None = None
        self._start_action: Callable[[float], list[Event]] = self._start

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def submit(self, seq: Sequence, now: float) -> list[Event]:
        self.scheduler.add(seq)
        if self.watch is not None:
            self.watch.add(self.index)
        return [] if self.busy else [Event(now, self._start_action)]

    def sync_cache(self) -> None:
        """Replay the pool's stored/evicted events into ``cached``."""
        cached = self.cached
        for kind, h in self.pool.drain_events():
            if kind == "stored":
                cached.add(h)
            else:
                cached.discard(h)

    # -- one iteration -------------------------------------------------------------------
    def _start(self, now: float) -> list[Event]:
        if self.busy:
            return []
        begun = self._begin(now)
        if begun is None:
            return []
        step, dt = begun
        return [Event(now + dt, lambda t: self._end(step, t))]

    def _begin(self, now: float) -> tuple[ScheduledStep, float] | None:
        """Schedule and cost the next iteration; None (and the cache synced) if idle."""
        sched = self.scheduler
        if self.watch is not None:
            self.watch.add(self.index)
        step = sched.schedule(now)
        while step.is_empty and sched.waiting and not sched.running:
            # Nothing runs and the head cannot be admitted into an empty pool: it never will.
            seq = sched.waiting[0]
            sched.finish(seq.request_id, FinishReason.ABORT, now)
            self.listener.on_unservable(self, seq, now)
            step = sched.schedule(now)
        if not step.entries:
            self.sync_cache()
            return None
        batch = [(n, seq.num_computed_tokens) for seq, n in step.entries]
        self.prefill_tokens += sum(n for n, _ in batch if n > 1)
        if self._stage_time is not None and not any(step.sample_flags()):
            # sequence pipelining: nothing waits for this step's outputs, so the next
            # step enters as soon as this one leaves the first stage
            dt = self._stage_time(batch)
        else:
            dt = self.cost.batch_time(batch)
        if len(batch) > self.peak_batch:
            self.peak_batch = len(batch)
        used = self.pool.num_blocks - self.pool.num_free
        if used > self.peak_blocks:
            self.peak_blocks = used
        self.busy = True
        self.busy_time += dt
        self.iterations += 1
        return step, dt

    def _end(self, step: ScheduledStep, now: float) -> list[Event]:
        loop = self.loop
        listener = self.listener
        sched = self.scheduler
        while True:
            if self.watch is not None:
                self.watch.add(self.index)
            # ScheduledStep.samples, inlined: the step reaches the sequence's last known token.
            sampling = [s for s, n in step.entries if s.num_computed_tokens + n == len(s.token_ids)]
            finished = sched.update(
                step, dict.fromkeys((s.request_id for s in sampling), DUMMY_TOKEN), now
            )
            for seq in sampling:
                listener.on_token(self, seq, now)
            events: list[Event] = []
            for seq in finished:
                events += listener.on_finished(self, seq, now)
            self.sync_cache()
            self.busy = False
            if not (sched.waiting or sched.running):
                return events
            begun = self._begin(now)  # the next iteration starts at once
            if begun is None:
                return events
            step, dt = begun
            end = now + dt
            if loop is None:
                return events + [Event(end, partial(self._end, step))]
            loop.extend(events)
            if loop.next_time() <= end:
                return [Event(end, partial(self._end, step))]
            # Nothing else happens before this iteration ends: run it in place.
            now = loop.now = end
            loop.fired += 1
