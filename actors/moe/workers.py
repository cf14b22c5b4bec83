"""The attention worker and the expert worker of a disaggregated MoE replica.

A step runs in rounds ``(layer, micro-batch)``. The attention worker's
``attention_round(layer, j, *inputs)``:

- ``layer == 0``: ``inputs`` is the step plan; it takes its share of the plan (the requests
  whose KV it holds, ``attention_worker_of``), micro-batch j of it, and embeds the tokens;
- ``layer > 0``: ``inputs`` are the expert workers' replies for layer - 1 of micro-batch j,
  which it puts back into its (token, choice) slots and combines into the residual;
- ``layer < L``: it runs layer ``layer``'s attention and router and returns one
  ``ExpertBatch`` per expert worker (every expert worker gets one, empty or not);
- ``layer == L``: final norm, LM head and sampling: an ``AttentionResult``.

The expert worker's ``expert_round(layer, j, *batches)`` takes one batch from every
attention worker, runs each expert it holds once over the rows of all senders together (the
point of disaggregation: experts see the tokens of every attention worker at once) and
returns one ``ExpertReply`` per attention worker. A hot expert held by several expert workers
gets its rows spread round-robin over them (``ExpertPlacement.worker_for``).

Plain classes: the in-process executor calls them directly, the Ray executor makes them
actors and wires the rounds into one compiled graph.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engine.channel_bytes import use_channel_bytes
from actors.engine.sampling import sample_tokens
from actors.engine.step_plan import StepPlan
from actors.engine.thread_priority import once_on_this_thread, run_process_at_normal_priority
from actors.engine.worker_inputs import WorkerInputs, build_worker_inputs
from actors.moe.messages import (
    AttentionResult,
    ExpertBatch,
    ExpertReply,
    MoESpec,
    StageTime,
    from_wire,
    split_plan,
    to_wire,
    worker_cores,
)
from kernels.kv_cache import allocate_kv_cache
from kernels.moe import ExpertDispatch
from models import load_model
from models.moe_split import AttentionPart, ExpertPart
from policies.expert_balance import ExpertPlacement
from store.transfer.links import EXEC, Link


def pin_process(cores: list[int]) -> list[int]:
    """Every thread of this process (and the threads they start later) on ``cores`` at nice
    0, and torch's intra-op threads as many as the cores; returns the affinity this thread runs
    with now. Empty ``cores``: left as it is. For a worker actor's process, never the
    driver's (``LocalMoEExecutor`` does not pin)."""
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:  # no /proc: this thread only
            tids = [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, set(cores))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
        torch.set_num_threads(len(cores))
        # pinned, a thread cannot move off a busy core: at Ray's worker niceness (15) any
        # nice-0 process on its cores starves it, model loading included
        run_process_at_normal_priority()
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def compute_link(spec: MoESpec, name: str) -> Link | None:
    """A worker's emulated compute link (``spec.link_bytes_per_s``), or None."""
    rate = spec.link_bytes_per_s
    return None if rate is None else Link(f"compute:{name}", rate)


def sent_bytes(link: Link | None) -> int:
    """Activation bytes a worker's link carried so far (0 without a link)."""
    return 0 if link is None else link.bytes[EXEC]


def _flat(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Inputs as one flat tuple: a compiled graph hands a method with one destination its
    whole returned tuple rather than the tuple's only element."""
    return tuple(v for x in values for v in (x if isinstance(x, tuple) else (x,)))


@dataclass
class _MicroBatch:
    inputs: WorkerInputs
    x: torch.Tensor  # [T, H] residual stream
    # the layer in flight: routing weights [T, k], dispatch, and for each expert worker the
    # rows (indices into dispatch order) it was sent
    weights: torch.Tensor | None = None
    dispatch: ExpertDispatch | None = None
    routes: list[torch.Tensor] | None = None
    timings: list[StageTime] | None = None
    served: dict[int, int] | None = None  # rows per expert over its rounds (worker 0)


class AttentionWorker:
    def __init__(self, spec: MoESpec, index: int) -> None:
        use_channel_bytes()
        self.link = compute_link(spec, f"attention{index}")
        self.spec = spec
        self.index = index
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.part: AttentionPart | None = None
        self.kv_caches: list = []
        self._step_id = -1
        self._plans: list[StepPlan] = []
        self._mbs: dict[int, _MicroBatch] = {}
        # replica table of the placement, and each expert's row counter per round
        self._replicas = spec.placement.replica_table()

    def setup(self) -> int:
        spec = self.spec
        model = load_model(Path(spec.model_dir), self.dtype, self.device, spec.attention_backend)
        self.part = AttentionPart(model)
        cfg = model.config
        self.kv_caches = allocate_kv_cache(
            cfg.num_hidden_layers,
            spec.num_blocks,
            spec.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        return self.index

    def ping(self) -> bool:
        return True

    def pin(self) -> list[int]:
        """This worker's process on its share of ``spec.attention_cores`` (see
        ``pin_process``); the cores it runs on."""
        spec = self.spec
        return pin_process(worker_cores(spec.attention_cores, spec.attention_workers, self.index))

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Send rows by a new expert placement from the next round on (between steps)."""
        if placement.num_workers != self.spec.expert_workers:
            raise ValueError("a new placement must keep the number of expert workers")
        self.spec = dataclasses.replace(self.spec, placement=placement)
        self._replicas = placement.replica_table()

    @torch.inference_mode()
    def attention_round(
        self, layer: int, micro_batch: int, *inputs: StepPlan | ExpertReply
    ) -> tuple[ExpertBatch, ...] | AttentionResult:
        once_on_this_thread()  # the thread running the rounds: nice 0 (thread_priority)
        began = time.time()
        part = self.part
        assert part is not None, "call setup() first"
        inputs = _flat(inputs)
        if layer == 0:
            (plan,) = inputs
            assert isinstance(plan, StepPlan)
            mb = self._begin(plan, micro_batch)
        else:
            mb = self._mbs[micro_batch]
            self._combine(mb, inputs)
        assert mb.timings is not None
        if layer == part.num_layers:
            result = self._finish(mb, micro_batch)
            result.timings.append(("attention", self.index, layer, micro_batch, began, time.time()))
            del self._mbs[micro_batch]
            return result
        out = self._attend(mb, layer, micro_batch)
        mb.timings.append(("attention", self.index, layer, micro_batch, began, time.time()))
        return out

    def _begin(self, plan: StepPlan, micro_batch: int) -> _MicroBatch:
        spec = self.spec
        if plan.step_id != self._step_id:
            self._step_id = plan.step_id
            split = split_plan(plan, spec.attention_workers, spec.micro_batches)
            self._plans = split[self.index]
        inputs = build_worker_inputs(self._plans[micro_batch], 0, 1, spec.block_size, self.device)
        assert self.part is not None
        x = self.part.embed(inputs.input_ids)
        mb = _MicroBatch(inputs, x, timings=[], served={})
        self._mbs[micro_batch] = mb
        return mb

    def _attend(self, mb: _MicroBatch, layer: int, micro_batch: int) -> tuple[ExpertBatch, ...]:
        part = self.part
        assert part is not None
        n_e = self.spec.expert_workers
        if mb.x.shape[0]:
            mb.x, h = part.attend(
                layer, mb.x, mb.inputs.positions, self.kv_caches[layer], mb.inputs.meta
            )
        else:  # nothing of this worker in this micro-batch: empty messages all the same
            h = mb.x
        weights, grouped, plan = part.route(layer, h)
        # Destination of each row: copies of a replicated expert take turns, starting at a
        # different copy on each attention worker.
        dest = torch.empty(grouped.shape[0], dtype=torch.int64)
        row_expert = torch.empty(grouped.shape[0], dtype=torch.int64)
        for e in range(part.num_experts):
            rows = plan.slab(e)
            if rows.stop > rows.start:
                copies = torch.tensor(self._replicas[e], dtype=torch.int64)
                turn = torch.arange(rows.stop - rows.start) + self.index
                dest[rows] = copies[turn % len(copies)]
                row_expert[rows] = e
        routes = [torch.nonzero(dest == w).flatten() for w in range(n_e)]
        mb.weights, mb.dispatch, mb.routes = weights, plan, routes
        batches = tuple(
            ExpertBatch(
                self._step_id,
                layer,
                micro_batch,
                self.index,
                to_wire(grouped.index_select(0, idx.to(grouped.device))),
                row_expert[idx].numpy(),
            )
            for idx in routes
        )
        if self.link is not None:
            self.link.send(sum(b.hidden.nbytes + b.experts.nbytes for b in batches), EXEC)
        return batches

    def _combine(self, mb: _MicroBatch, replies: tuple[StepPlan | ExpertReply, ...]) -> None:
        assert mb.dispatch is not None and mb.routes is not None and mb.weights is not None
        assert mb.timings is not None
        n = mb.dispatch.offsets[-1]
        expert_out = torch.empty(n, mb.x.shape[1], dtype=mb.x.dtype, device=mb.x.device)
        for w, reply in enumerate(replies):
            assert isinstance(reply, ExpertReply) and reply.sender == w
            idx = mb.routes[w]
            if len(idx):
                expert_out[idx.to(mb.x.device)] = from_wire(reply.out, self.dtype, self.device)
            mb.timings.extend(reply.timings)
            assert mb.served is not None
            for e, rows in reply.served.items():
                mb.served[e] = mb.served.get(e, 0) + rows
        if mb.x.shape[0]:
            mb.x = AttentionPart.combine(mb.x, expert_out, mb.dispatch, mb.weights)
        mb.weights = mb.dispatch = mb.routes = None

    def _finish(self, mb: _MicroBatch, micro_batch: int) -> AttentionResult:
        part = self.part
        assert part is not None and mb.timings is not None
        result = AttentionResult(
            self._step_id, micro_batch, {}, {}, list(mb.timings), dict(mb.served or {})
        )
        inputs = mb.inputs
        if inputs.sample_rows:
            hidden = part.final(mb.x)
            rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=hidden.device)
            logits = part.compute_logits(hidden.index_select(0, rows))
            for rid, s in zip(
                inputs.sample_ids, sample_tokens(logits, inputs.sample_specs), strict=True
            ):
                result.tokens[rid] = s.token_id
                if s.logprob is not None:
                    result.logprobs[rid] = s.logprob
        return result


class ExpertWorker:
    def __init__(self, spec: MoESpec, index: int) -> None:
        use_channel_bytes()
        self.link = compute_link(spec, f"expert{index}")
        self.spec = spec
        self.index = index
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.experts = spec.placement.workers[index]
        self.part: ExpertPart | None = None
        self.rounds = 0  # rounds answered (every round reaches every expert worker)
        # rows per held expert in each of the last rounds: (layer, micro-batch, counts)
        self.recent: deque[tuple[int, int, dict[int, int]]] = deque(maxlen=256)

    def setup(self) -> int:
        spec = self.spec
        model = load_model(Path(spec.model_dir), self.dtype, self.device, spec.attention_backend)
        self.part = ExpertPart(model, self.experts)
        return self.index

    def ping(self) -> bool:
        return True

    def pin(self) -> list[int]:
        """This worker's process on its share of ``spec.expert_cores`` (see
        ``pin_process``); the cores it runs on."""
        spec = self.spec
        return pin_process(worker_cores(spec.expert_cores, spec.expert_workers, self.index))

    @torch.inference_mode()
    def expert_round(
        self, layer: int, micro_batch: int, *batches: ExpertBatch
    ) -> tuple[ExpertReply, ...]:
        once_on_this_thread()  # the thread running the rounds: nice 0 (thread_priority)
        began = time.time()
        part = self.part
        assert part is not None, "call setup() first"
        self.rounds += 1
        batches = _flat(batches)
        hidden = [from_wire(b.hidden, self.dtype, self.device) for b in batches]
        experts = [torch.from_numpy(np.array(b.experts)) for b in batches]
        outs = [torch.empty_like(h) for h in hidden]
        served: dict[int, int] = {}
        for e in self.experts:
            picks = [torch.nonzero(ex == e).flatten() for ex in experts]
            sizes = [len(p) for p in picks]
            served[e] = sum(sizes)
            if not sum(sizes):
                continue
            rows = torch.cat([h.index_select(0, p) for h, p in zip(hidden, picks, strict=True)])
            y = part.run(layer, e, rows)
            for out, p, part_y in zip(outs, picks, y.split(sizes), strict=True):
                if len(p):
                    out[p] = part_y
        self.recent.append((layer, micro_batch, served))
        step_id = batches[0].step_id if batches else -1
        wire = [to_wire(out) for out in outs]
        if self.link is not None:
            self.link.send(sum(w.nbytes for w in wire), EXEC)
        timing: StageTime = ("expert", self.index, layer, micro_batch, began, time.time())
        return tuple(
            ExpertReply(
                step_id,
                layer,
                micro_batch,
                self.index,
                w,
                [timing] if a == 0 else [],
                served if a == 0 else {},
            )
            for a, w in enumerate(wire)
        )
