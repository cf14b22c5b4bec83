"""The compact plan a replica controller sends its workers once per iteration.

Everything a worker needs and nothing it owns: which requests run, which tokens, at which
positions, in which KV blocks (per KV-parallel rank), and how to sample. Workers hold the
weights and KV tensors; the controller holds the scheduler and block tables. A plan is
plain data (pickled onto a compiled-graph channel), so it stays small: token ids of the new
tokens only and block ids, never KV bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actors.engine.sampling import SampleSpec, TokenLogprob

# (kvp rank, first token position it holds, its block ids in position order). A request's
# shards cover positions [0, start + n) in order; every shard but the last holds exactly
# the rank token limit (a multiple of the block size), so shards start on block boundaries.
Shard = tuple[int, int, list[int]]


@dataclass
class PlanEntry:
    request_id: str
    start: int  # position of the first new token
    token_ids: list[int]  # the n new tokens, positions [start, start + n)
    shards: list[Shard]
    sample: SampleSpec | None  # None: the range does not reach the last known token
    # Where the request's KV is streamed as it is computed (a prefill replica's requests:
    # an ``actors.disagg.kv_stream.KVDestination``), from block ``stream_from_block`` of
    # its table (0 on its first step, so a cached prefix is sent too).
    kv_dest: Any = None
    stream_from_block: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def compute_rank(self) -> int:
        """The KV-parallel rank that runs this request's tokens: the holder of its newest
        token. Other ranks holding earlier shards only answer attention queries."""
        last = self.end - 1
        for rank, first, _ in reversed(self.shards):
            if first <= last:
                return rank
        raise ValueError(f"request {self.request_id!r}: no shard holds position {last}")

    @property
    def is_distributed(self) -> bool:
        return len(self.shards) > 1


@dataclass
class StepPlan:
    step_id: int
    entries: list[PlanEntry] = field(default_factory=list)
    # keep the sampled tokens on the device, unread (``StepResult.unread``), for the next
    # plan to feed where its tokens are ``PLACEHOLDER`` (actors/engine/token_feed.py)
    keep_tokens: bool = False

    @property
    def needs_kv_exchange(self) -> bool:
        """Same answer on every worker: whether any request spans KV-parallel ranks."""
        return any(len(e.shards) > 1 for e in self.entries)


@dataclass
class DeviceTokens:
    """One step's sampled tokens, still where they were sampled."""

    request_ids: list[str]  # row i was sampled for request_ids[i]
    tokens: torch.Tensor  # [S] int64

    def read(self) -> dict[str, int]:
        """Request id -> token (waits for the device)."""
        return dict(zip(self.request_ids, self.tokens.tolist(), strict=True))


@dataclass
class StepResult:
    """What the last pipeline stage of one KV-parallel rank returns."""

    step_id: int
    tokens: dict[str, int]  # request id -> sampled token, for the entries it computed
    # (stage, start, end) wall-clock seconds of each stage that handled the step
    timings: list[tuple[int, float, float]] = field(default_factory=list)
    # what the workers' StepHook.end_step returned (actors.engine.worker_hooks), every
    # worker that handled the step
    hook_reports: list[Any] = field(default_factory=list)
    # request id -> the sampled token's logprobs, for requests that asked for them
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # sampled tokens not yet in ``tokens``, still on the device (``StepPlan.keep_tokens``)
    unread: DeviceTokens | None = None

    def read(self) -> StepResult:
        """Bring ``unread`` tokens into ``tokens`` (waits for the device); returns self."""
        if self.unread is not None:
            self.tokens.update(self.unread.read())
            self.unread = None
        return self

    def compute_seconds(self) -> float:
        """Seconds the step's stages computed, summed over its pipeline stages: each stage's
        ``end - start`` on its own clock (so no two workers' clocks are compared), the
        waits between stages not counted."""
        return sum(end - start for _, start, end in self.timings)
