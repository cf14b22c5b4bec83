"""Deadline-aware orderings of prefills (Medha, section 4.2): EDF, LRS and ILRS.

Every request has a TTFT deadline ``arrival + slo``: ``slo`` is the request's own
``ttft_slo`` when it gave one, else derived from its length when first seen,
``max(min_slo, slo_factor * its predicted prefill time alone)`` (Medha derives deadlines
from isolated runs), and then fixed on the sequence. With ``r`` its remaining prefill time
(predicted for its uncomputed prompt tokens after its computed context):

    EDF   key = deadline
    LRS   key = deadline - now - r                       (slack, seconds)
    ILRS  key = (deadline - now - r) / slo               (slack relative to its deadline)

Smaller keys run first. The keys rank prefills only: a request past its prompt (a decode)
keys ahead of every prefill, in arrival order, so it is never a preemption victim and is
never reordered by slack. ILRS's relative slack does not let a stream of short requests
push a long one back forever (EDF does: a fresh short request's deadline is always near):
as a long request waits its relative slack falls below a fresh short one's.

``urgency`` (ILRS, LRS) is what prefill-prefill batching shares room by: 1 - relative slack,
clamped to [0, 1]. Pure: ``now`` is an argument; times come from an injected estimator.

Under sequence pipeline parallelism (``stages`` = spp > 1) a prompt's chunks are in flight
together, each in its own stage: with ``t_i`` the whole-model time of chunk ``i`` (what
the estimator predicts, with or without SPP) and each stage taking ``t_i / S``, the prompt
ends after ``sum(t_i) / S + (S - 1) * max(t_i) / S`` (a flow shop of equal stages). A
chunk's time grows with its context, so ``max(t_i)`` is priced as a full chunk at the end
of the prompt. One chunk (or ``S = 1``) is its whole-model time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from policies.ordering import FCFS, Ordering
from policies.registry import Registry
from policies.sequence import Sequence

DECODE = -math.inf  # the first key component of a request past its prompt


class PrefillEstimator(Protocol):
    """What the orderings need from a runtime predictor (``placement.runtime_predictor``):
    the whole-model time of ``new_tokens`` after ``context_tokens``, run alone in chunks of
    ``chunk_size`` tokens one after another."""

    @property
    def chunk_size(self) -> int: ...

    def remaining_prefill_time(self, new_tokens: int, context_tokens: int) -> float: ...


class Deadlines:
    """A request's TTFT SLO: its own, else ``max(min_slo, slo_factor * predicted prefill
    alone)``, or ``default_slo`` when given (one SLO for every request). ``stages``: the
    replica's sequence-pipeline stages (spp), which a prompt's chunks pipeline through."""

    def __init__(
        self,
        estimator: PrefillEstimator,
        default_slo: float | None = None,
        slo_factor: float = 3.0,
        min_slo: float = 0.0,
        stages: int = 1,
    ) -> None:
        if default_slo is not None and default_slo <= 0:
            raise ValueError("default_slo must be positive or None")
        if slo_factor <= 0 or min_slo < 0:
            raise ValueError("slo_factor must be positive and min_slo non-negative")
        if stages < 1:
            raise ValueError("stages must be at least 1")
        self.estimator = estimator
        self.default_slo = default_slo
        self.slo_factor = slo_factor
        self.min_slo = min_slo
        self.stages = stages

    def prefill_time(self, new_tokens: int, context_tokens: int) -> float:
        """Predicted seconds to compute ``new_tokens`` prompt tokens after
        ``context_tokens``, alone, their chunks pipelined through ``stages`` stages (the
        module docstring's flow shop)."""
        total = self.estimator.remaining_prefill_time(new_tokens, context_tokens)
        if self.stages == 1 or new_tokens <= 0:
            return total
        last = min(new_tokens, self.estimator.chunk_size)
        longest = self.estimator.remaining_prefill_time(last, context_tokens + new_tokens - last)
        return (total + (self.stages - 1) * min(longest, total)) / self.stages

    def slo(self, seq: Sequence) -> float:
        """Seconds from arrival to the TTFT deadline; fixed on ``seq`` when first asked."""
        if seq.ttft_slo is None:
            if self.default_slo is not None:
                seq.ttft_slo = self.default_slo
            else:
                alone = self.prefill_time(seq.num_prompt_tokens, 0)
                seq.ttft_slo = max(self.min_slo, self.slo_factor * alone, 1e-9)
        return seq.ttft_slo

    def deadline(self, seq: Sequence) -> float:
        return seq.arrival_time + self.slo(seq)

    def remaining(self, seq: Sequence) -> float:
        """Predicted seconds of prefill left: its prompt tokens neither computed nor in
        flight, after the context computed so far."""
        left = seq.num_prompt_tokens - seq.num_computed_tokens - seq.num_inflight_tokens
        if left <= 0:
            return 0.0
        return self.prefill_time(left, seq.num_computed_tokens)

    def slack(self, seq: Sequence, now: float) -> float:
        return self.deadline(seq) - now - self.remaining(seq)

    def relative_slack(self, seq: Sequence, now: float) -> float:
        return self.slack(seq, now) / self.slo(seq)


def _past_prompt(seq: Sequence) -> bool:
    return bool(seq.output_token_ids) and not seq.in_prefill


class EDF:
    """Earliest deadline first."""

    ranks_prefills = True  # the scheduler ranks running and waiting prefills together

    def __init__(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        if _past_prompt(seq):
            return (DECODE, seq.arrival_time)
        return (self.deadlines.deadline(seq), seq.arrival_time)

    def urgency(self, seq: Sequence, now: float) -> float:
        return 1.0


class LRS:
    """Least remaining slack, in seconds."""

    ranks_prefills = True

    def __init__(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        if _past_prompt(seq):
            return (DECODE, seq.arrival_time)
        return (self.deadlines.slack(seq, now), seq.arrival_time)

    def urgency(self, seq: Sequence, now: float) -> float:
        return min(1.0, max(0.0, 1.0 - self.deadlines.relative_slack(seq, now)))


class ILRS(LRS):
    """Input-length-aware least remaining slack: slack relative to the request's SLO."""

    def key(self, seq: Sequence, now: float) -> tuple[float, ...]:
        if _past_prompt(seq):
            return (DECODE, seq.arrival_time)
        return (self.deadlines.relative_slack(seq, now), seq.arrival_time)


# Every ordering by its ``scheduling`` name, each built from the replica's deadlines (FCFS
# ignores them).
ORDERINGS: Registry[Callable[[Deadlines], Ordering]] = Registry("scheduling policy")
ORDERINGS.add("fcfs", lambda deadlines: FCFS())
ORDERINGS.add("edf", EDF)
ORDERINGS.add("lrs", LRS)
ORDERINGS.add("ilrs", ILRS)
POLICIES = ORDERINGS.names()


def make_ordering(name: str, deadlines: Deadlines) -> Ordering:
    """The ordering ``name`` over ``deadlines``; ValueError naming the choices if unknown."""
    return ORDERINGS.get(name)(deadlines)
