"""Mooncake's Conductor: pick a (prefill, decode) pair for a request, or reject it (429).

Prefill (Algorithm 1, KVCache-centric). For request R with block keys K and each prefill
instance p with local prefix ``l_p`` blocks (leading keys of K that p holds), and the best
holder b with ``best_len`` blocks:

    T_queue(p)  = p.queue_time if given, else sum over p's queued requests q of
                  prefill_time(new(q), context(q))        (p.queued, each its own length)
                  else prefill_time(p.queued_tokens, 0)   (only a token count is known)
    local(p)    = prefill_time(new(l_p), cached(l_p))
    remote(p)   = transfer_time(best_len - l_p) + prefill_time(new(best_len), cached(best_len))
    TTFT(p)     = T_queue(p) + min(local(p), remote(p))      (remote only if best_len > l_p)

with ``cached(l) = min(l * block_size, prompt - 1)`` (the last prompt token is always
computed, it yields the first output token) and ``new(l) = prompt - cached(l)``. The chosen
p minimises TTFT (first in the given order on ties). When copying wins, ``transfer_from``
names b. Hot-block replication is a side effect: if b is not p and ``best_len / l_p >
replication_threshold`` (``l_p = 0`` counts as infinite), blocks ``K[l_p:best_len]`` are
reported for copying from b onto p, whether or not this request waits for them.

Decode. The request's KV needs ``ceil((prompt + max_tokens) / block_size)`` blocks for its
whole life; an instance has room if ``used_blocks + pending_blocks + need <= total_blocks``
now (KV streams into decode while prefill runs, so the space must be free now; requests
still in prefill already hold their reservation, ``pending_blocks``). Among those with room:

    TBT(d) = decode_tbt(running(d) + 1, context_blocks(d) + ceil(prompt / block_size))

with ``running`` and ``context_blocks`` the decodes running there now (``num_running``,
``used_blocks``): requests assigned but still in prefill (``pending``) are not decode load
yet, and this TBT is what admission judges. The instance is the one whose *committed* load
(running plus pending, ``pending_blocks``) gives the lowest TBT (ties: more free blocks,
then given order), so a burst of arrivals spreads. No room anywhere: reject
``decode_full``.

Admission (``admission``, default ``"predictive"``):
  - ``"none"``: only ``decode_full`` rejects; predictions are still reported.
  - ``"early"``: at arrival, reject when TTFT > ttft_slo or TBT(now) > tbt_slo (the larger
    of prefill and decode load), so no prefill is spent on a request decode would refuse.
    The chosen decode instance idle (nothing running or pending) never refuses on TBT.
  - ``"predictive"``: judge decode at ``at = now + TTFT``, when the request would reach it
    (see ``policies.admission``): running(d) and context_blocks(d) shrink by the decodes
    that end by ``at`` and grow by the requests prefill finishes by ``at``: the same share
    of each instance's ``pending`` requests (an even split when no view reports pending).
    A running decode ends at its ``finish_times`` entry when given, else after its
    ``remaining_tokens`` at the predicted TBT of the instance's committed batch,
    ``decode_tbt(running(d) + pending(d), context_blocks(d) + pending_blocks(d))`` (the
    pending requests join while those decode); with neither, decodes last a uniform t_d:
    ``decode_duration`` when set, else this request's ``max_tokens`` at that TBT. Decode
    is priced by the step-time predictor (refitted live from measured decode steps, each
    the gap between tokens it delivered), never by a constant. The predicted batch
    (running(at) + incoming + this request) is ``predicted_batch`` in the decision.
    With ``p.queued`` known, the requests prefill delivers by ``at`` are those whose
    cumulative prefill time in queue order ends by then.

Decode's tail (``early`` and ``predictive``). The decode pool checks a request's TBT again
when it lands there, with the step model refitted since admission; on a loaded host the
refit can price the same batch far higher. Admission therefore judges ``TBT(d) *
margin`` against the SLO, ``margin`` the ``tbt_quantile`` of recent decode steps'
measured / predicted time (``observe_decode_step``; ``adm.StepOverruns``, never below 1):
where steps run at the model, margin is about 1 and this is the model; where they run
over it, the Conductor refuses what the refit is about to refuse. Instance choice, the
reported ``predicted_tbt`` and ``decode_time`` keep the model itself (``tbt_margin`` in
the decision is the factor judged with).

Pure: no clock, no Ray; the runtime injects fitted regressions, the simulator its cost model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from policies import admission as adm
from policies.routing import cached_prefix_blocks


@dataclass
class PrefillInstance:
    """View of one prefill instance."""

    instance_id: str
    queued_tokens: int = 0  # uncomputed prompt tokens queued there
    cached: set[int] = field(default_factory=set)
    # Optional, more precise inputs: the summed predicted prefill time of the queue (the
    # paper's T_queue), and how many requests the queue holds (for the predictive mode).
    queue_time: float | None = None
    queued_requests: int | None = None
    # Optional: each queued request's (uncomputed tokens, context tokens), in serving order;
    # T_queue is then the sum of their own prefill times.
    queued: list[tuple[int, int]] | None = None


@dataclass
class DecodeInstance:
    instance_id: str
    num_running: int = 0
    used_blocks: int = 0
    total_blocks: int = 1
    # Optional predicted finish times of the running requests (for the prediction variant);
    # when given, one per running request.
    finish_times: list[float] = field(default_factory=list)
    # Optional tokens each running request may still generate (its max_tokens left; EOS may
    # end it sooner), one per running request: finish times priced at the predicted TBT.
    remaining_tokens: list[int] = field(default_factory=list)
    # Requests assigned here whose prefill (or KV transfer) is not done, and the lifetime
    # blocks reserved for them: room is taken now, decode load comes later.
    pending: int = 0
    pending_blocks: int = 0


@dataclass
class ConductorRequest:
    request_id: str
    block_hashes: list[int]
    num_prompt_tokens: int
    max_tokens: int
    block_size: int


@dataclass
class ConductorDecision:
    accepted: bool
    prefill_id: str | None
    decode_id: str | None
    cached_blocks: int  # prefix blocks reused on the chosen prefill instance
    transfer_from: str | None  # instance whose blocks are copied to the chosen one
    replicate_blocks: list[int]  # hot block hashes to replicate onto prefill_id
    predicted_ttft: float
    predicted_tbt: float
    retry_after: float | None  # seconds, when rejected
    reason: str  # "ttft_slo", "tbt_slo", "decode_full", or "" when accepted
    replicate_from: str | None = None  # source of replicate_blocks (the best holder)
    predicted_batch: int = 0  # decodes (this request included) predicted_tbt is priced at
    tbt_margin: float = 1.0  # admission judged predicted_tbt * tbt_margin against the SLO


@dataclass
class _PrefillChoice:
    index: int
    ttft: float
    queue_time: float
    cached_blocks: int
    transfer_from: str | None
    replicate_blocks: list[int]
    replicate_from: str | None


@dataclass
class _DecodeChoice:
    index: int
    tbt: float
    batch: int  # decodes the TBT is priced at, this request included


class Conductor:
    def __init__(
        self,
        prefill_time: Callable[[int, int], float],
        decode_tbt: Callable[[int, int], float],
        transfer_time: Callable[[int], float],
        ttft_slo: float,
        tbt_slo: float,
        replication_threshold: float = 2.0,
        admission: str = "predictive",
        decode_duration: float | None = None,
        min_retry_after: float = 1.0,
        tbt_quantile: float = 0.9,
    ) -> None:
        """``prefill_time(new tokens, cached tokens)`` and ``transfer_time(blocks)`` are in
        seconds; ``decode_tbt(batch size, total context blocks)`` is seconds per token;
        ``decode_duration`` is the uniform decode length t_d of the prediction variant
        (None: a request's ``max_tokens`` at the predicted TBT, ``decode_time``);
        ``min_retry_after`` is the floor of every Retry-After; ``tbt_quantile``: the
        quantile of decode steps' measured / predicted time admission scales TBT by."""
        if admission not in adm.ADMISSION_MODES:
            raise ValueError(f"admission must be one of {adm.ADMISSION_MODES}, not {admission!r}")
        if ttft_slo <= 0 or tbt_slo <= 0:
            raise ValueError("SLOs must be positive")
        if not 0.0 <= tbt_quantile <= 1.0:
            raise ValueError("tbt_quantile must be in [0, 1]")
        self.prefill_time = prefill_time
        self.decode_tbt = decode_tbt
        self.transfer_time = transfer_time
        self.ttft_slo = ttft_slo
        self.tbt_slo = tbt_slo
        self.replication_threshold = replication_threshold
        self.admission = admission
        self.decode_duration = decode_duration
        self.min_retry_after = min_retry_after
        self.tbt_quantile = tbt_quantile
        self.decode_overruns = adm.StepOverruns()

    # -- decode's measured tail ----------------------------------------------------------------
    def observe_decode_step(self, batch_size: int, context_blocks: int, seconds: float) -> None:
        """One measured decode step (``batch_size`` requests, ``context_blocks`` blocks),
        against ``decode_tbt`` now in force. Feed it steps measured under a fitted model
        only: against a starting guess the ratios say nothing about the host."""
        self.decode_overruns.add(seconds, self.decode_tbt(batch_size, context_blocks))

    def tbt_margin(self) -> float:
        """The factor admission scales the predicted TBT by (see the module docstring)."""
        return self.decode_overruns.margin(self.tbt_quantile)

    # -- prefill -----------------------------------------------------------------------------
    def queue_time(self, p: PrefillInstance) -> float:
        if p.queue_time is not None:
            return p.queue_time
        if p.queued is not None:
            return sum(self.prefill_time(n, c) for n, c in p.queued)
        return self.prefill_time(p.queued_tokens, 0) if p.queued_tokens > 0 else 0.0

    def _prefill_cost(self, request: ConductorRequest, blocks: int) -> float:
        n = request.num_prompt_tokens
        cached = max(0, min(blocks * request.block_size, n - 1))
        return self.prefill_time(n - cached, cached)

    def select_prefill(
        self, request: ConductorRequest, prefills: Sequence[PrefillInstance]
    ) -> _PrefillChoice:
        """Algorithm 1, lines 3-16 and 20-21 (see the module docstring)."""
        hashes = request.block_hashes
        local = [cached_prefix_blocks(hashes, p.cached) for p in prefills]
        # Best holder: longest prefix, ties by the lighter queue (a less congested sender).
        best = min(range(len(prefills)), key=lambda i: (-local[i], prefills[i].queued_tokens))
        best_len = local[best]
        # Prefill time depends only on the cached blocks: compute each distinct count once.
        costs: dict[int, float] = {}
        for blocks in local:
            if blocks not in costs:
                costs[blocks] = self._prefill_cost(request, blocks)
        remote_prefill = costs[best_len]
        choice: _PrefillChoice | None = None
        for i, p in enumerate(prefills):
            t_queue = self.queue_time(p)
            t_exec, blocks, source = costs[local[i]], local[i], None
            if best_len > local[i]:
                t_remote = self.transfer_time(best_len - local[i]) + remote_prefill
                if t_remote < t_exec:
                    t_exec, blocks, source = t_remote, best_len, prefills[best].instance_id
            ttft = adm.predict_ttft(t_queue, t_exec)
            if choice is None or ttft < choice.ttft:
                choice = _PrefillChoice(i, ttft, t_queue, blocks, source, [], None)
        assert choice is not None
        l_p = local[choice.index]
        if best != choice.index and best_len > l_p:
            ratio = math.inf if l_p == 0 else best_len / l_p
            if ratio > self.replication_threshold:
                choice.replicate_blocks = list(hashes[l_p:best_len])
                choice.replicate_from = prefills[best].instance_id
        return choice

    # -- decode ------------------------------------------------------------------------------
    def decode_time(self, request: ConductorRequest, d: DecodeInstance) -> float:
        """t_d: ``decode_duration`` when set, else ``request.max_tokens`` steps at ``d``'s
        predicted TBT with the request joining its running decodes."""
        if self.decode_duration is not None:
            return self.decode_duration
        prompt_blocks = -(-request.num_prompt_tokens // request.block_size)
        tbt = self.decode_tbt(d.num_running + 1, d.used_blocks + prompt_blocks)
        return request.max_tokens * tbt

    def finish_times(self, d: DecodeInstance, now: float) -> list[float]:
        """When each running decode on ``d`` ends: ``d.finish_times`` if kept, else its
        ``remaining_tokens`` at the predicted TBT of the committed batch (running plus
        ``pending``: requests admitted and still in prefill join it while those decode);
        [] when neither matches ``num_running`` (then t_d applies)."""
        if d.finish_times:
            return d.finish_times
        if d.num_running == 0 or len(d.remaining_tokens) != d.num_running:
            return []
        tbt = self.decode_tbt(d.num_running + d.pending, d.used_blocks + d.pending_blocks)
        return [now + r * tbt for r in d.remaining_tokens]

    @staticmethod
    def decode_blocks(request: ConductorRequest) -> int:
        """KV blocks for the request's whole life: ``ceil((prompt + max_tokens) / bs)``."""
        return -(-(request.num_prompt_tokens + request.max_tokens) // request.block_size)

    def select_decode(
        self,
        request: ConductorRequest,
        decodes: Sequence[DecodeInstance],
        now: float,
        arrive_at: float | None = None,
        incoming: Sequence[tuple[float, float]] | None = None,
    ) -> _DecodeChoice | None:
        """The instance with room now and the lowest load; None if none has room.

        Without ``arrive_at``: the returned TBT is judged on the decodes running now, and
        instances are ranked by the TBT of their committed load (running plus pending).
        With it, both are the load expected then: ``running_at`` of the current decodes,
        their blocks scaled by the same surviving fraction, plus ``incoming[i] =
        (requests, blocks)`` that prefill delivers to instance i by then.
        """
        need = self.decode_blocks(request)
        prompt_blocks = -(-request.num_prompt_tokens // request.block_size)
        best: _DecodeChoice | None = None
        best_key, best_free = math.inf, -1
        for i, d in enumerate(decodes):
            free = d.total_blocks - d.used_blocks - d.pending_blocks
            if need > free:
                continue
            if arrive_at is None:
                # Judged on the decodes running now; ranked by the committed load (those
                # plus the pending ones), so a burst does not all pick the same instance.
                batch = d.num_running + 1
                tbt = self.decode_tbt(batch, d.used_blocks + prompt_blocks)
                key = self.decode_tbt(
                    d.num_running + d.pending + 1, d.used_blocks + d.pending_blocks + prompt_blocks
                )
            else:
                running = adm.running_at(
                    d.num_running,
                    self.finish_times(d, now),
                    now,
                    arrive_at,
                    self.decode_time(request, d),
                )
                context = float(d.used_blocks)
                if d.num_running > 0:
                    context = d.used_blocks * running / d.num_running
                if incoming is not None:
                    running += incoming[i][0]
                    context += incoming[i][1]
                batch = math.ceil(running) + 1
                tbt = self.decode_tbt(batch, math.ceil(context) + prompt_blocks)
                key = tbt
            if best is None or key < best_key or (key == best_key and free > best_free):
                best, best_key, best_free = _DecodeChoice(i, tbt, batch), key, free
        return best

    def _incoming_per_decode(
        self,
        request: ConductorRequest,
        prefills: Sequence[PrefillInstance],
        chosen: int,
        dt: float,
        decodes: Sequence[DecodeInstance],
    ) -> list[tuple[float, float]]:
        """(requests, blocks) each decode instance receives from prefill within ``dt``.

        Pool-wide: everything queued on the chosen prefill instance finishes before this
        request (FIFO); on the others, with ``queued`` known, the requests whose cumulative
        prefill time ends within ``dt`` (``adm.prefill_done_within``), else
        ``prefill_done_by``. A queue of unknown request count
        is taken to hold requests as long as this one; each brings its queued tokens' share
        of blocks. Per decode instance: when the views report ``pending`` requests, each
        instance gets the pool-wide done share of its own pending requests and blocks (the
        queues hold exactly those); otherwise an even split, as decode selection balances.
        """
        requests = blocks = 0.0
        queued = 0.0
        for i, p in enumerate(prefills):
            if p.queued is not None and p.queue_time is None:
                times = [self.prefill_time(n, c) for n, c in p.queued]
                k = len(times) if i == chosen else adm.prefill_done_within(times, dt)
                queued += len(times)
                requests += k
                blocks += sum(n + c for n, c in p.queued[:k]) / request.block_size
                continue
            if p.queued_tokens <= 0 and not p.queued_requests:
                continue
            count = p.queued_requests
            if count is None:
                count = max(1, -(-p.queued_tokens // max(1, request.num_prompt_tokens)))
            done = (
                float(count) if i == chosen else adm.prefill_done_by(count, self.queue_time(p), dt)
            )
            queued += count
            requests += done
            blocks += done * p.queued_tokens / max(1, count) / request.block_size
        pending = sum(d.pending for d in decodes)
        if pending > 0:
            share = min(1.0, requests / queued) if queued > 0 else 1.0
            return [(d.pending * share, d.pending_blocks * share) for d in decodes]
        n = len(decodes)
        return [(requests / n, blocks / n)] * n

    # -- Retry-After -------------------------------------------------------------------------
    def _tbt_retry_after(
        self, request: ConductorRequest, decodes: Sequence[DecodeInstance], now: float
    ) -> float:
        """Over instances: the time until enough running decodes finish (k of them, the
        fewest) that ``decode_tbt(running - k + 1, blocks of the rest + prompt)`` meets the
        SLO and the request's blocks fit; the soonest instance wins, t_d if none ever does."""
        need = self.decode_blocks(request)
        prompt_blocks = -(-request.num_prompt_tokens // request.block_size)
        slo = self.tbt_slo / self.tbt_margin()
        best = math.inf
        for d in decodes:
            per = adm.blocks_per_request(d.used_blocks, d.num_running)

            def fits(k: int, d: DecodeInstance = d, per: int = per) -> bool:
                used = max(0, d.used_blocks - k * per)
                tbt = self.decode_tbt(d.num_running - k + 1, used + prompt_blocks)
                return used + d.pending_blocks + need <= d.total_blocks and tbt <= slo

            k = adm.finishes_needed(fits, d.num_running)
            if k is not None:
                t_d = self.decode_time(request, d)
                ends = self.finish_times(d, now)
                best = min(best, adm.time_until_finished(k, d.num_running, ends, now, t_d))
        if math.isinf(best):
            return max(self.decode_time(request, d) for d in decodes)
        return best

    # -- the decision ------------------------------------------------------------------------
    def schedule(
        self,
        request: ConductorRequest,
        prefills: Sequence[PrefillInstance],
        decodes: Sequence[DecodeInstance],
        now: float,
    ) -> ConductorDecision:
        if not prefills or not decodes:
            raise ValueError("the Conductor needs at least one prefill and one decode instance")
        pre = self.select_prefill(request, prefills)
        arrive_at: float | None = None
        incoming: list[tuple[float, float]] | None = None
        if self.admission == "predictive":
            arrive_at = now + pre.ttft
            incoming = self._incoming_per_decode(request, prefills, pre.index, pre.ttft, decodes)
        dec = self.select_decode(request, decodes, now, arrive_at, incoming)

        ttft, tbt = pre.ttft, (dec.tbt if dec is not None else math.inf)
        batch = dec.batch if dec is not None else 0
        margin = self.tbt_margin() if self.admission != "none" else 1.0
        reason, retry = "", 0.0
        if dec is None:
            reason = "decode_full"
            retry = self._tbt_retry_after(request, decodes, now)
        elif self.admission != "none":
            # Early rejection: the shared TTFT rule, and its TBT counterpart (the larger
            # load decides, ``adm.slo_load``). An idle decode instance never refuses on TBT:
            # no load of others is the cause, and its fitted TBT learns only from the
            # steps it runs (refusing there would refuse forever on a stale fit).
            chosen = decodes[dec.index]
            idle = chosen.num_running == 0 and chosen.pending == 0
            judged = adm.judge_ttft(ttft, self.ttft_slo)
            tbt_ratio = 0.0 if idle else tbt * margin / self.tbt_slo
            if max(judged.load, tbt_ratio) > 1:
                reason = "ttft_slo" if judged.load >= tbt_ratio else "tbt_slo"
                # Retry when both pools have drained enough: the later of the two estimates.
                retry = judged.retry_after
                if tbt_ratio > 1:
                    retry = max(retry, self._tbt_retry_after(request, decodes, now))
        if reason:
            return ConductorDecision(
                accepted=False,
                prefill_id=None,
                decode_id=None,
                cached_blocks=0,
                transfer_from=None,
                replicate_blocks=[],
                predicted_ttft=ttft,
                predicted_tbt=tbt,
                retry_after=adm.retry_after_at_least(retry, self.min_retry_after),
                reason=reason,
                predicted_batch=batch,
                tbt_margin=margin,
            )
        assert dec is not None
        return ConductorDecision(
            accepted=True,
            prefill_id=prefills[pre.index].instance_id,
            decode_id=decodes[dec.index].instance_id,
            cached_blocks=pre.cached_blocks,
            transfer_from=pre.transfer_from,
            replicate_blocks=pre.replicate_blocks,
            predicted_ttft=ttft,
            predicted_tbt=tbt,
            retry_after=None,
            reason="",
            replicate_from=pre.replicate_from,
            predicted_batch=batch,
            tbt_margin=margin,
        )


def apply_decision(
    decision: ConductorDecision,
    request: ConductorRequest,
    prefills: Sequence[PrefillInstance],
    decodes: Sequence[DecodeInstance],
    now: float,
) -> None:
    """Update the views for an accepted decision before fresh stats arrive ("updates the
    cache and queue times for that instance accordingly").

    Prefill: queue += uncomputed tokens; it will hold every prompt block (and the
    replicated ones). Decode: the request is ``pending`` there, its lifetime blocks
    reserved, until its KV lands (``start_decode``). ``now`` is kept for callers that
    stamp the decision.
    """
    del now
    if not decision.accepted:
        return
    p = next(x for x in prefills if x.instance_id == decision.prefill_id)
    d = next(x for x in decodes if x.instance_id == decision.decode_id)
    n = request.num_prompt_tokens
    cached = max(0, min(decision.cached_blocks * request.block_size, n - 1))
    p.queued_tokens += n - cached
    if p.queue_time is not None:
        p.queue_time = decision.predicted_ttft
    if p.queued_requests is not None:
        p.queued_requests += 1
    if p.queued is not None:
        p.queued.append((n - cached, cached))
    p.cached.update(request.block_hashes)
    p.cached.update(decision.replicate_blocks)
    d.pending += 1
    d.pending_blocks += Conductor.decode_blocks(request)


def start_decode(d: DecodeInstance, blocks: int, finish_time: float | None = None) -> None:
    """A pending request's KV has landed: it moves from ``pending`` to running, its
    ``blocks`` from reserved to used. ``finish_time`` is appended when ``finish_times`` is
    maintained (one entry per running request)."""
    if d.pending <= 0 or d.pending_blocks < blocks:
        raise ValueError(f"{d.instance_id}: no pending request of {blocks} blocks")
    d.pending -= 1
    d.pending_blocks -= blocks
    if finish_time is not None and len(d.finish_times) == d.num_running:
        d.finish_times.append(finish_time)
    d.num_running += 1
    d.used_blocks += blocks


def finish_decode(d: DecodeInstance, blocks: int) -> None:
    """A running request finished on ``d``: its blocks are free again."""
    if d.num_running <= 0 or d.used_blocks < blocks:
        raise ValueError(f"{d.instance_id}: no running request of {blocks} blocks")
    d.num_running -= 1
    d.used_blocks -= blocks
