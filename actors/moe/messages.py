"""What attention and expert workers exchange, and how a step's batch is split among them.

Per layer and micro-batch (a *round*), every attention worker sends every expert worker one
``ExpertBatch`` (M2N; possibly with no rows) and every expert worker answers every attention
worker with one ``ExpertReply`` (N2M) whose rows are in the order of the batch it answers,
so the sender puts them back in its own (token, choice) slots without ids on the wire.
Arrays are numpy: compiled-graph channels on CPU move numpy far faster than torch tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.engine.outputs import TokenLogprob
from actors.engine.step_plan import PlanEntry, StepPlan
from policies.expert_balance import ExpertPlacement

# (kind "attention"/"expert", worker index, layer, micro-batch, start s, end s)
StageTime = tuple[str, int, int, int, float, float]


@dataclass(frozen=True)
class MoESpec:
    """Picklable: how to build every worker of a disaggregated MoE replica."""

    model_dir: str
    dtype: str  # a torch dtype name
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int  # each attention worker's KV pool (block ids are the controller's)
    attention_workers: int
    placement: ExpertPlacement  # which experts each expert worker holds
    micro_batches: int
    # cores of every attention (expert) worker together (empty: not pinned); worker i of
    # a kind runs on ``worker_cores(cores, workers of the kind, i)``
    attention_cores: tuple[int, ...] = ()
    expert_cores: tuple[int, ...] = ()
    # each worker's compute link, bytes/s (an emulated NIC, ``store/transfer/links.py``):
    # the activations it sends (attention -> experts, replies back) pay it as EXEC traffic
    # before they leave (None: not limited)
    link_bytes_per_s: float | None = None

    @property
    def expert_workers(self) -> int:
        return self.placement.num_workers


def worker_cores(cores: Sequence[int], workers: int, index: int) -> list[int]:
    """Worker ``index``'s share of ``cores`` among ``workers`` of its kind: disjoint runs of
    consecutive ids (sizes differing by at most one) when there are at least as many cores
    as workers, else one core each, taken in turn (workers then share cores)."""
    ids = sorted(cores)
    if not ids:
        return []
    if len(ids) < workers:
        return [ids[index % len(ids)]]
    size, extra = divmod(len(ids), workers)
    start = index * size + min(index, extra)
    return ids[start : start + size + (1 if index < extra else 0)]


@dataclass
class ExpertBatch:
    """M2N: one attention worker's rows for one expert worker, one round."""

    step_id: int
    layer: int
    micro_batch: int
    sender: int  # attention worker index
    hidden: np.ndarray  # [n, H] post-attention-norm rows, grouped by expert (ascending)
    experts: np.ndarray  # [n] int64: the expert each row goes through


@dataclass
class ExpertReply:
    """N2M: an expert worker's outputs for one attention worker's batch, same row order."""

    step_id: int
    layer: int
    micro_batch: int
    sender: int  # expert worker index
    out: np.ndarray  # [n, H]
    # to attention worker 0 only: the round's stage time and rows per expert (all senders)
    timings: list[StageTime] = field(default_factory=list)
    served: dict[int, int] = field(default_factory=dict)


@dataclass
class AttentionResult:
    """What an attention worker returns for one micro-batch at the end of a step."""

    step_id: int
    micro_batch: int
    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    timings: list[StageTime] = field(default_factory=list)
    expert_rows: dict[int, int] = field(default_factory=dict)  # rows per expert, all rounds


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy (bf16 travels as its int16 bits)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.numpy()


def from_wire(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Back to a tensor (copied: received arrays are read-only)."""
    t = torch.from_numpy(np.array(a))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device)


def attention_worker_of(request_id: str, attention_workers: int) -> int:
    """The attention worker that holds a request's KV for its whole life (stable across
    steps, restarts and processes)."""
    return zlib.crc32(request_id.encode()) % attention_workers


def micro_batches_of(entries: list[PlanEntry], m: int) -> list[list[PlanEntry]]:
    """``entries`` (one attention worker's, in plan order) in ``m`` contiguous groups of
    nearly equal token counts; groups may be empty when there are fewer entries than m."""
    total = sum(e.num_tokens for e in entries)
    groups: list[list[PlanEntry]] = [[] for _ in range(m)]
    done = 0
    for e in entries:
        # the group whose share of the tokens this entry's middle falls in
        index = min(m - 1, (2 * done + e.num_tokens) * m // (2 * total)) if total else 0
        groups[index].append(e)
        done += e.num_tokens
    return groups


def split_plan(plan: StepPlan, attention_workers: int, m: int) -> list[list[StepPlan]]:
    """``split_plan(...)[a][j]``: the sub-plan attention worker ``a`` runs as micro-batch j."""
    mine: list[list[PlanEntry]] = [[] for _ in range(attention_workers)]
    for e in plan.entries:
        if e.is_distributed:
            raise ValueError("KV-parallel requests cannot run on a disaggregated MoE replica")
        mine[attention_worker_of(e.request_id, attention_workers)].append(e)
    return [[StepPlan(plan.step_id, group) for group in micro_batches_of(es, m)] for es in mine]
