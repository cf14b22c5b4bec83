"""Medha's batch packer (sections 3.2 and 4.2): adaptive chunks and prefill-prefill batching.

Given the iteration's decodes (already in the batch) and the prefills that want tokens, in
priority order, it sizes each prefill's chunk with a runtime predictor:

- the long prefill (the one with the most tokens left) gets the largest chunk that keeps
  the predicted batch time under the step's target, never below the predictor's efficient
  minimum at its context offset. The target is ``target_batch_time`` (seconds: the
  decodes' TPOT target), or ``decode_slowdown`` times the predicted time of the step's
  decodes alone (a decode's gap grows at most that much while prompts prefill beside it;
  a step without decodes has no target but the budget). A relative target needs no
  per-model figure, and a predictor's uniform error (its cold start) cancels out of it.
  Attention grows with the context, so the same time buys fewer tokens as its KV grows:
  chunks shrink.
- prefills ranked ahead of the long one (more urgent) take what they need first, up to
  the target; those ranked behind it ride in the room it leaves: a share ``min(max_share,
  their highest urgency)`` of the time left is theirs (urgency from the ordering, 1 -
  relative slack; 1 without one), filled in priority order; room they do not use goes
  back to the long one, and room the long one does not use (its prompt ends) to them.
- the batch's time stays at most the target, except that one prefill always runs when no
  other does (the most urgent, at its efficient minimum): prefill never stalls because the
  decodes alone are over the target.

Pure and stdlib only: the predictor is injected (``placement.runtime_predictor``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

Batch = Sequence[tuple[int, int]]  # (new tokens, context tokens) per request


class StepPredictor(Protocol):
    def batch_time(self, batch: Batch) -> float: ...

    def efficient_chunk(self, context_tokens: int) -> int: ...

    def largest_chunk(
        self, batch: Batch, context_tokens: int, target: float, limit: int
    ) -> int: ...


class Packer(Protocol):
    """What a scheduler asks of a packer: tokens per candidate this step, in order."""

    def pack(
        self, decodes: Batch, candidates: Sequence[PrefillCandidate], budget: int
    ) -> list[int]: ...


@dataclass(frozen=True)
class PrefillCandidate:
    uncomputed: int  # tokens neither computed nor in flight (at least 1)
    context: int  # tokens before its next chunk (computed and in flight)
    urgency: float = 1.0  # in [0, 1]; 1 - relative slack under a slack ordering


class BatchPacker:
    def __init__(
        self,
        predictor: StepPredictor,
        target_batch_time: float | None = None,
        max_share: float = 0.5,
        max_chunk: int | None = None,
        min_chunk: int = 1,
        decode_slowdown: float | None = None,
    ) -> None:
        if (target_batch_time is None) == (decode_slowdown is None):
            raise ValueError("give target_batch_time or decode_slowdown, one of them")
        if target_batch_time is not None and not target_batch_time > 0:
            raise ValueError("target_batch_time must be positive (seconds per iteration)")
        if decode_slowdown is not None and not decode_slowdown > 1:
            raise ValueError("decode_slowdown must be above 1 (a step's time over its decodes')")
        if not 0.0 <= max_share <= 1.0:
            raise ValueError("max_share must be in [0, 1]")
        if (max_chunk is not None and max_chunk < 1) or min_chunk < 1:
            raise ValueError("max_chunk and min_chunk must be at least 1")
        self.predictor = predictor
        self.target = target_batch_time
        self.decode_slowdown = decode_slowdown
        self.max_share = max_share
        self.max_chunk = max_chunk
        self.min_chunk = min_chunk

    def floor(self, context: int) -> int:
        """The smallest chunk worth running at ``context``: the predictor's efficient
        minimum, at least ``min_chunk`` and at most ``max_chunk``."""
        n = max(self.min_chunk, self.predictor.efficient_chunk(context))
        return n if self.max_chunk is None else min(n, self.max_chunk)

    def step_target(self, decodes: Batch) -> float:
        """Seconds this step may take: the fixed target, or ``decode_slowdown`` times the
        decodes' own predicted time (inf without decodes)."""
        if self.target is not None:
            return self.target
        if not decodes:
            return math.inf
        assert self.decode_slowdown is not None
        return self.decode_slowdown * self.predictor.batch_time(decodes)

    def pack(
        self, decodes: Batch, candidates: Sequence[PrefillCandidate], budget: int
    ) -> list[int]:
        """Tokens per candidate this iteration (0: not this time), at most ``budget`` in
        all. ``candidates`` are in priority order, most urgent first."""
        chunks = [0] * len(candidates)
        if not candidates or budget <= 0:
            return chunks
        p = self.predictor
        target = self.step_target(decodes)
        batch = list(decodes)
        longest = max(range(len(candidates)), key=lambda i: candidates[i].uncomputed)
        ahead, behind = range(longest), range(longest + 1, len(candidates))

        def cap(i: int) -> int:
            c = candidates[i]
            n = min(c.uncomputed - chunks[i], budget)
            return n if self.max_chunk is None else min(n, self.max_chunk - chunks[i])

        def grow(i: int, until: float) -> None:
            """Give candidate ``i`` the most extra tokens with the batch under ``until``."""
            nonlocal budget
            c = candidates[i]
            limit = cap(i)
            if limit <= 0:
                return
            if chunks[i]:
                batch.remove((chunks[i], c.context))
            n = max(chunks[i], p.largest_chunk(batch, c.context, until, limit + chunks[i]))
            if n:
                batch.append((n, c.context))
            budget -= n - chunks[i]
            chunks[i] = n

        # Prefills more urgent than the long one take what they need, up to the target.
        for i in ahead:
            grow(i, target)
        # The long one, leaving the less urgent ones their share of the room.
        share = 0.0
        if behind:
            share = min(self.max_share, max(candidates[i].urgency for i in behind))
        start = p.batch_time(batch)
        room = max(0.0, target - start)
        grow(longest, start + (1.0 - share) * room if share < 1.0 else start)
        big = candidates[longest]
        floor = min(self.floor(big.context), big.uncomputed)
        have = chunks[longest]
        if have < floor:  # below its efficient minimum: its floor if the target allows
            if have:
                batch.remove((have, big.context))
            if floor - have <= budget and p.batch_time([*batch, (floor, big.context)]) <= target:
                batch.append((floor, big.context))
                budget -= floor - have
                chunks[longest] = floor
            else:
                budget += have
                chunks[longest] = 0
        # The less urgent ones ride in the rest, in priority order; then whatever is left.
        for i in behind:
            grow(i, target)
        if chunks[longest] and budget > 0:
            grow(longest, target)
        if not any(chunks):  # progress: the most urgent runs its efficient minimum
            first = candidates[0]
            n = min(self.floor(first.context), first.uncomputed, budget)
            chunks[0] = max(n, 0)
        return chunks
