"""Continuous batching under a per-iteration token budget.

Each ``schedule`` call returns ``{request: number of tokens}`` for one iteration: running
requests in decode take one token each first (decode is never starved by prefill), then
prompt chunks of running and waiting requests fill what is left of the budget (sized by the
chunk rule, or with a packer by a runtime predictor, Medha's ``BatchPacker`` or DualPath's
``AttentionQuotaPacker``, running and waiting prefills ranked together). A request is
admitted only when the free KV blocks cover what every admitted request may still grow by
(prompt + max_tokens), so a decode always finds its next block. When a prefill's KV cannot
grow, the prefill that the ordering ranks last is preempted: its blocks are freed and it is
recomputed later from its tokens. A request past its prompt (a decode) is never preempted.

Steps may be pipelined: ``schedule`` can be called again before ``update`` of the previous
steps. Scheduled tokens count as in flight (``Sequence.num_inflight_tokens``) until their
step's ``update``; a request waiting for a sampled token is not scheduled again, and a
request with tokens in flight is never preempted (its blocks are being written). Steps
must be updated in the order they were scheduled.

Pure: no clock, no torch, no Ray. ``now`` is an argument; KV space is asked of an injected
``KVManager`` so the live engine and the simulator share this exact code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from policies.batch_packer import Packer, PrefillCandidate
from policies.chunking import ChunkRule, FixedChunk
from policies.ordering import FCFS, Ordering
from policies.sequence import FinishReason, SeqStatus, Sequence

PLACEHOLDER = -1  # a sampled token whose value is not known yet (``Scheduler.advance``)


class KVManager(Protocol):
    """What the scheduler needs from the KV cache (``store.kv_manager.KVCacheManager``)."""

    block_size: int
    enable_prefix_caching: bool

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable), over every pool."""
        ...

    @property
    def num_total_blocks(self) -> int:
        """Blocks of every pool."""
        ...

    def free_blocks_per_rank(self) -> list[int]:
        """Blocks that can be handed out now, per KV rank (one entry: a single pool)."""
        ...

    def blocks_per_rank(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Blocks ``seq``'s first ``num_tokens`` tokens occupy on each KV rank: its blocks
        live on the ranks its shards are placed on, so space is checked rank by rank."""
        ...

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks of ``seq``'s prefix; returns how many tokens they cover."""
        ...

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Ensure blocks for ``seq``'s first ``num_tokens`` tokens; False if out of space."""
        ...

    def commit(self, seq: Sequence) -> None:
        """Publish ``seq``'s fully computed blocks to the prefix cache."""
        ...

    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds."""
        ...


def _plus(a: list[int], b: list[int]) -> list[int]:
    """Per-rank block counts added."""
    return [x + y for x, y in zip(a, b, strict=True)]


@dataclass
class SchedulerConfig:
    token_budget: int  # tokens computed per iteration, all requests together (the engine's
    # default: actors/engine/defaults.py)
    max_num_seqs: int = 256  # requests running at once
    max_prefills: int = 16  # prefills a batch packer sizes per iteration (the most urgent)
    # prompt tokens an iteration may carry beside decodes (None: what the decodes leave of
    # the token budget); an iteration without decodes takes the whole budget
    prefill_beside_decodes: int | None = None

    def __post_init__(self) -> None:
        if self.token_budget <= 0 or self.max_num_seqs <= 0 or self.max_prefills <= 0:
            raise ValueError("token_budget, max_num_seqs and max_prefills must be positive")
        if self.prefill_beside_decodes is not None and self.prefill_beside_decodes <= 0:
            raise ValueError("prefill_beside_decodes must be positive or None")


@dataclass
class ScheduledStep:
    """One iteration's plan: ``entries`` in batch order, each (sequence, tokens to compute).

    A sequence computes tokens ``[num_computed_tokens, num_computed_tokens + n)``; it samples
    a token when that range reaches its last known token.
    """

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position of each entry's tokens
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> dict[str, int]:
        return {seq.request_id: n for seq, n in self.entries}

    @property
    def is_empty(self) -> bool:
        return not self.entries

    def sample_flags(self) -> list[bool]:
        """Per entry: does its range reach the sequence's last known token (so it samples)?"""
        return [
            start + n == seq.num_tokens
            for (seq, n), start in zip(self.entries, self.starts, strict=True)
        ]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        ordering: Ordering | None = None,
        chunk_rule: ChunkRule | None = None,
        packer: Packer | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.ordering: Ordering = ordering or FCFS()
        self.chunk_rule: ChunkRule = chunk_rule or FixedChunk(None)
        # With a packer, prefills (running and waiting together, in priority order) are
        # sized by it (adaptive chunks, prefill-prefill batching) instead of ``chunk_rule``.
        self.packer = packer
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    # -- requests in and out -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if seq.num_tokens == 0:
            raise ValueError("a request needs at least one token")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def add_running(self, seq: Sequence, now: float) -> None:
        """Admit a request whose KV for ``num_computed_tokens`` tokens is already in the
        blocks the KV manager holds for it (computed elsewhere: prefill/decode
        disaggregation). It joins the running set directly; the caller appends the token
        that computation sampled through ``update`` of a zero-token entry."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if not 0 < seq.num_computed_tokens <= seq.num_tokens:
            raise ValueError("a running request needs computed tokens within its length")
        seq.status = SeqStatus.RUNNING
        seq.num_inflight_tokens = 0
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.running.append(seq)
        self._by_id[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def finish(self, request_id: str, reason: FinishReason, now: float) -> Sequence | None:
        """End a request now (abort, or a stop string the caller detected)."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason, now)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, over all requests (a load signal for routers)."""
        waiting = sum(s.num_uncomputed_tokens for s in self.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in self.running if s.in_prefill)

    # -- one iteration ---------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledStep:
        step = ScheduledStep()
        entries = step.entries
        budget = self.config.token_budget
        running = self.running
        key = self.ordering.key
        if len(running) > 1:
            running.sort(key=lambda s: key(s, now))
        scheduled: set[str] = set()

        # Decodes first, then running prefills; both in priority order. (``in_prefill``
        # inlined: more than the newest token still lacks KV.)
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for s in running:
            pending = len(s.token_ids) - s.num_computed_tokens - s.num_inflight_tokens
            if pending > 1:
                prefills.append(s)
            elif pending == 1:
                decodes.append(s)
            # pending == 0: its sampled token is still in flight
        allocate = self.kv.allocate
        starts = step.starts
        together = self.packer is not None or self.ordering.ranks_prefills
        queues = [(decodes, False)] if together else [(decodes, False), (prefills, True)]
        for queue, is_prefill in queues:
            if is_prefill:
                budget = self._prefill_budget(budget, entries)
            for seq in queue:
                if budget == 0:
                    break
                if seq.status is not SeqStatus.RUNNING:
                    continue  # preempted earlier in this loop (or finished)
                n = self.chunk_rule.chunk(seq, budget) if is_prefill else 1
                if n <= 0:
                    continue
                start = seq.num_computed_tokens + seq.num_inflight_tokens
                if not allocate(seq, start + n) and not self._preempt_until_fits(
                    seq, n, step, scheduled
                ):
                    continue
                entries.append((seq, n))
                starts.append(start)
                seq.num_inflight_tokens += n
                scheduled.add(seq.request_id)
                budget -= n

        if together:
            budget = self._prefill_budget(budget, entries)
            self._schedule_prefills(step, prefills, budget, scheduled, now)
            return step

        # Waiting requests join in priority order; strict order: the first that does not fit
        # blocks the rest, so a long request is not overtaken forever.
        waiting = self.waiting
        if not waiting:
            return step
        if len(waiting) > 1:
            waiting.sort(key=lambda s: key(s, now))
        reserve = None
        computing = self._computing(prefills)
        i = 0
        while i < len(waiting) and budget > 0 and len(running) < self.config.max_num_seqs:
            seq = waiting[i]
            self._match_prefix(seq)
            if self._waits_for_a_sharer(seq, computing):
                self._unmatch(seq)
                i += 1  # a deferral is no memory wait: those behind it may go
                continue
            n = self.chunk_rule.chunk(seq, budget)
            if reserve is None:
                reserve = self._reserved_growth()
            if n <= 0 or not self._admit(seq, n, reserve):
                break
            reserve = _plus(reserve, self._growth(seq, n))
            waiting.pop(i)
            self._start_running(seq, n, step, scheduled, now)
            computing |= self._computing([seq])
            budget -= n
        return step

    def _prefill_budget(self, budget: int, entries: list[tuple[Sequence, int]]) -> int:
        """The prompt tokens this iteration may still take, once its decodes (``entries``,
        every one a single token) are in: capped at ``prefill_beside_decodes`` if any."""
        cap = self.config.prefill_beside_decodes
        return budget if cap is None or not entries else min(budget, cap)

    # -- prompts that share a prefix ----------------------------------------------------------
    # A waiting request whose next uncached prompt block is one a running prefill is
    # computing waits for it (its next match then attaches it), rather than computing the
    # same block beside it: ``n`` samples of one prompt (GRPO's groups), or turns behind a
    # shared system prompt, prefill the shared blocks once. Only with prefix caching; a
    # deferred request never blocks those behind it, and it waits only while a running
    # prefill still has that block to compute (one that is preempted stops counting).
    def _computing(self, prefills: list[Sequence]) -> set[int]:
        """Hashes of the full prompt blocks ``prefills`` have not computed yet."""
        if not self.kv.enable_prefix_caching:
            return set()
        bs = self.kv.block_size
        return {h for s in prefills for h in s.block_hashes[s.num_computed_tokens // bs :]}

    def _waits_for_a_sharer(self, seq: Sequence, computing: set[int]) -> bool:
        """``seq``'s next uncached usable block (the last token's block is always computed)
        is one a running prefill is computing."""
        if not computing:
            return False
        bs = self.kv.block_size
        k = seq.num_computed_tokens // bs
        return k < (seq.num_tokens - 1) // bs and seq.block_hashes[k] in computing

    # -- admission and KV reservation --------------------------------------------------------
    # A request admitted reserves the KV blocks its whole life needs (prompt + max_tokens,
    # capped at what the pools hold): a new request joins only when the free blocks cover
    # what every running request may still grow by. So a decode always finds its next block
    # (the free blocks only run short for prefills, which yield or wait): decodes are never
    # preempted. Counted per KV rank (a vector, one entry per rank): a request's blocks live
    # on the ranks its shards are placed on, so free blocks on another rank do not cover it.
    def _growth(self, seq: Sequence, extra: int = 0) -> list[int]:
        """Blocks per rank ``seq`` may still need beyond what it holds after ``extra`` more
        tokens."""
        final = self.kv.blocks_per_rank(seq, seq.num_prompt_tokens + seq.max_tokens - 1)
        held = self.kv.blocks_per_rank(
            seq, seq.num_computed_tokens + seq.num_inflight_tokens + extra
        )
        return [max(0, f - h) for f, h in zip(final, held, strict=True)]

    def _reserved_growth(self) -> list[int]:
        total = [0] * len(self.kv.free_blocks_per_rank())
        for s in self.running:
            total = _plus(total, self._growth(s))
        return total

    def _fits(self, reserve: list[int], need: list[int]) -> bool:
        """Every rank's free blocks cover what is reserved there plus ``need``."""
        free = self.kv.free_blocks_per_rank()
        return all(f >= r + n for f, r, n in zip(free, reserve, need, strict=True))

    def _match_prefix(self, seq: Sequence) -> None:
        if seq.num_computed_tokens == 0:
            seq.num_cached_tokens = self.kv.match_prefix(seq)
            seq.num_computed_tokens = seq.num_cached_tokens

    def _admit(self, seq: Sequence, n: int, reserve: list[int] | None) -> bool:
        """Allocate a waiting request's first ``n`` tokens if the blocks left still cover
        ``reserve`` and its own growth; else let go of what it holds (a matched prefix),
        so a waiting request pins no blocks."""
        if self.kv.allocate(seq, seq.num_computed_tokens + n):
            need = self._growth(seq, n)
            if self._fits(reserve if reserve is not None else [0] * len(need), need):
                return True
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        return False

    def _start_running(
        self, seq: Sequence, n: int, step: ScheduledStep, scheduled: set[str], now: float
    ) -> None:
        seq.status = SeqStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.running.append(seq)
        step.entries.append((seq, n))
        step.starts.append(seq.num_computed_tokens)
        seq.num_inflight_tokens = n
        scheduled.add(seq.request_id)

    # -- Medha: running and waiting prefills ranked together -------------------------------
    def _schedule_prefills(
        self,
        step: ScheduledStep,
        running_prefills: list[Sequence],
        budget: int,
        scheduled: set[str],
        now: float,
    ) -> None:
        """Running and waiting prefills ranked together (re-sorted every iteration, so a
        partial prefill competes with new ones; a deadline ordering asks for this with
        ``ranks_prefills``). The top ``max_prefills`` are sized by the packer when there is
        one, else by the chunk rule in rank order. A waiting request that does not fit in
        memory waits, and so does every waiting request ranked after it (they would take
        the blocks it waits for)."""
        packer = self.packer
        key = self.ordering.key
        urgency = self.ordering.urgency
        pool = [s for s in running_prefills if s.status is SeqStatus.RUNNING]
        slots = self.config.max_num_seqs - len(self.running)
        waiting = self.waiting
        if len(waiting) > 1:
            waiting.sort(key=lambda s: key(s, now))
        pool += waiting[: max(0, slots)]
        if not pool or budget <= 0:
            return
        pool.sort(key=lambda s: key(s, now))
        # Waiting ones are admissible only while the free blocks cover every admitted
        # request's growth and theirs (independent of the chunk: its blocks are part of
        # that growth); the first that is not waits, and so do those ranked after it.
        reserve = self._reserved_growth()
        blocked = False
        chosen: list[Sequence] = []
        computing = self._computing([s for s in pool if s.status is SeqStatus.RUNNING])
        for seq in pool:
            if len(chosen) == self.config.max_prefills:
                break
            if seq.status is SeqStatus.WAITING:
                if blocked:
                    continue
                self._match_prefix(seq)
                if self._waits_for_a_sharer(seq, computing):
                    self._unmatch(seq)
                    continue
                growth = self._growth(seq)
                if not self._fits(reserve, growth):
                    self._unmatch(seq)
                    blocked = True
                    continue
                reserve = _plus(reserve, growth)
                computing |= self._computing([seq])
            chosen.append(seq)
        if packer is not None:
            candidates = [
                PrefillCandidate(
                    s.num_uncomputed_tokens,
                    s.num_computed_tokens + s.num_inflight_tokens,
                    urgency(s, now),
                )
                for s in chosen
            ]
            decodes = [(n, at) for (_, n), at in zip(step.entries, step.starts, strict=True)]
            chunks = packer.pack(decodes, candidates, budget)
        else:
            chunks = []
            for s in chosen:
                n = self.chunk_rule.chunk(s, budget)
                chunks.append(n)
                budget -= n
        for seq, n in zip(chosen, chunks, strict=True):
            if seq.status is SeqStatus.WAITING:
                if n <= 0 or not self._admit(seq, n, None):
                    self._unmatch(seq)  # not this time
                    continue
                self.waiting.remove(seq)
                self._start_running(seq, n, step, scheduled, now)
                continue
            if n <= 0 or seq.status is not SeqStatus.RUNNING:
                continue  # not this time, or preempted for an earlier entry
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            if not self.kv.allocate(seq, start + n) and not self._preempt_until_fits(
                seq, n, step, scheduled
            ):
                continue
            step.entries.append((seq, n))
            step.starts.append(start)
            seq.num_inflight_tokens += n
            scheduled.add(seq.request_id)

    def _unmatch(self, seq: Sequence) -> None:
        """A waiting request not admitted this time lets go of its matched prefix."""
        if seq.status is SeqStatus.WAITING:
            self.kv.free(seq)
            seq.num_computed_tokens = 0

    def _preempt_until_fits(
        self, seq: Sequence, n: int, step: ScheduledStep, scheduled: set[str]
    ) -> bool:
        """Find KV space for ``n`` more tokens of ``seq`` after a first allocation failed,
        preempting lower-ranked prefills; False if ``seq`` cannot run this step. A request
        past its prompt (a decode) is never a victim: prefills yield, or ``seq`` waits."""
        while True:
            victims = [
                s
                for s in self.running
                if s.request_id not in scheduled
                and not s.num_inflight_tokens
                and len(s.token_ids) - s.num_computed_tokens > 1  # still in prefill
            ]
            if not victims:
                return False  # decodes and steps in flight only: wait for one to return
            victim = victims[-1]  # ranked last; may be seq itself
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
            if self.kv.allocate(seq, seq.num_computed_tokens + seq.num_inflight_tokens + n):
                return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)

    def recompute_all(self) -> list[Sequence]:
        """Every running request loses its KV (e.g. its workers died) and waits to be
        recomputed from its tokens, ahead of new requests and in its current order. Only
        valid when no step is in flight any more (the caller discarded them)."""
        lost = list(self.running)
        for seq in reversed(lost):
            seq.num_inflight_tokens = 0
            self._preempt(seq)
        return lost

    # -- after the model ran ---------------------------------------------------------------
    # ``update`` = ``settle(advance(...))``. Split, a controller can schedule and plan the
    # next step before this step's token values are known (host work overlapping the
    # device's): ``advance`` does what depends only on the step's shape and appends
    # ``PLACEHOLDER`` for each sampled token; ``settle`` writes the values in. Invariant: a
    # placeholder is only ever the newest token of a running request, and it is settled
    # before the request's next ``advance`` (so KV is never committed or hashed over one).
    def update(self, step: ScheduledStep, sampled: dict[str, int], now: float) -> list[Sequence]:
        """Advance every scheduled request; append sampled tokens; return those that finished.

        ``sampled`` holds one token per request whose step reached its last known token.
        Requests finished or aborted while the step ran are skipped.
        """
        advanced = self.advance(step, now)
        self.settle(advanced, sampled, now)
        return [s for s in advanced if s.is_finished]

    def advance(self, step: ScheduledStep, now: float) -> list[Sequence]:
        """The value-independent half of ``update``: computed tokens move on, full blocks are
        committed, and every request whose step sampled gets ``PLACEHOLDER`` as its newest
        token (it finishes with LENGTH if that was its last allowed token). Returns those
        requests, in step order. Requests finished or aborted while the step ran are
        skipped."""
        advanced = []
        commit = self.kv.commit
        running = SeqStatus.RUNNING
        for seq, n in step.entries:
            seq.num_inflight_tokens -= n
            if seq.status is not running:
                continue
            samples = seq.num_computed_tokens + n == len(seq.token_ids)  # ScheduledStep.samples
            seq.num_computed_tokens += n
            commit(seq)
            if not samples:
                continue
            seq.append_token(PLACEHOLDER)
            advanced.append(seq)
            if len(seq.output_token_ids) >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH, now)
        return advanced

    def settle(self, advanced: list[Sequence], sampled: dict[str, int], now: float) -> None:
        """The token values of ``advance``'s requests (``sampled``: request id -> token) in
        place of their placeholders; a stop token finishes a request with STOP (also one
        that reached max_tokens on it, or that finished after ``advance``, except an
        abort)."""
        for seq in advanced:
            token = sampled[seq.request_id]
            seq.set_last_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token in seq.stop_token_ids:
                if seq.is_finished:
                    seq.stopped_on_last_token()
                else:
                    self._finish(seq, FinishReason.STOP, now)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        if seq.is_finished:
            return
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason, now)
        self._by_id.pop(seq.request_id, None)
