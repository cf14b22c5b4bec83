"""The scheduler's view of one request: its tokens and how far its KV has been computed.

Invariant: ``0 <= num_computed_tokens <= num_computed_tokens + num_inflight_tokens <=
num_tokens``. A step that brings the computed tokens up to ``num_tokens`` samples one new
token, so a request in decode has ``num_computed_tokens == num_tokens - 1`` between steps.
``num_inflight_tokens`` counts tokens scheduled in steps that have not returned yet (a
pipelined replica keeps several steps in flight; otherwise it is 0 between steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from policies.request import Request


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop token or stop string
    ABORT = "abort"  # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    salt: str | None = None  # tenant salt of the prefix-cache hashes
    priority: float = 0.0  # for orderings other than FCFS; lower runs first
    # seconds from arrival to its TTFT deadline (policies.slack); None: derived when needed
    ttft_slo: float | None = None

    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0  # scheduled in steps that have not returned yet
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Chained hashes of the full blocks of ``token_ids`` known so far: a prefix of them, from
    # the request; the KV manager extends them as blocks fill and never recomputes one.
    block_hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)  # prompt followed by output

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @classmethod
    def from_request(
        cls, request: Request, stop_token_ids: frozenset[int] = frozenset(), priority: float = 0.0
    ) -> Sequence:
        """The scheduler's view of ``request``. ``block_hashes`` start as a copy of the
        request's (computed once, at the edge); the KV manager only extends that copy."""
        return cls(
            request.request_id,
            list(request.prompt_token_ids),
            request.params.max_tokens,
            arrival_time=request.arrival_time,
            stop_token_ids=stop_token_ids,
            salt=request.salt,
            priority=priority,
            ttft_slo=request.params.ttft_slo,
            block_hashes=list(request.block_hashes),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens neither computed nor in flight."""
        return self.num_tokens - self.num_computed_tokens - self.num_inflight_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the newest token still lacks KV (a prompt or a recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def finish(self, reason: FinishReason, now: float) -> None:
        """Mark it ended (the scheduler frees its blocks first, if it held any)."""
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = now

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def set_last_token(self, token_id: int) -> None:
        """The newest token's value, in place of what ``append_token`` held for it (the
        scheduler's placeholder)."""
        self.output_token_ids[-1] = token_id
        self.token_ids[-1] = token_id

    def stopped_on_last_token(self) -> None:
        """An ended request's newest token was a stop token or completed a stop string: it
        ends with STOP, whatever it first ended for on that token (max_tokens); an abort
        stays an abort."""
        if self.finish_reason is not FinishReason.ABORT:
            self.finish_reason = FinishReason.STOP
