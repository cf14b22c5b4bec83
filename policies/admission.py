"""Overload arithmetic for the Conductor: decode load in the near future, and Retry-After.

Mooncake judges load by SLO attainment: a pool is loaded when its predicted TTFT (prefill)
or TBT (decode) exceeds the limit. Early rejection judges both at arrival. Because a
request reaches decode only after its prefill (``now + TTFT``), judging decode by its
*current* load makes prefill and decode load oscillate in anti-phase; the prediction
variant instead estimates decode load at that moment:

    running(at) = running now - those whose decode ends by ``at``
                  + requests whose prefill ends by ``at``

Every function here is plain arithmetic on numbers, so the live runtime, the simulator and
the tests share it. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

ADMISSION_MODES = ("predictive", "early", "none")


def slo_load(ttft: float, tbt: float, ttft_slo: float, tbt_slo: float) -> float:
    """Load as SLO attainment: ``max(ttft / ttft_slo, tbt / tbt_slo)``; > 1 means overloaded.

    Taking the larger of the prefill and the decode ratio is Mooncake's early rejection.
    """
    return max(ttft / ttft_slo, tbt / tbt_slo)


def running_at(
    num_running: int,
    finish_times: Sequence[float],
    now: float,
    at: float,
    decode_duration: float,
) -> float:
    """Expected number of the currently running decodes still running at time ``at``.

    With predicted ``finish_times`` (one per running request): those with a finish time
    after ``at``. Without them, Mooncake's assumption that every decode lasts a uniform
    ``decode_duration`` t_d, and running requests started uniformly over the last t_d
    (steady state), so a fraction ``min(1, (at - now) / t_d)`` of them ends by ``at``:

        ``running(at) = num_running * max(0, 1 - (at - now) / t_d)``
    """
    if finish_times:
        return float(sum(1 for f in finish_times if f > at))
    if decode_duration <= 0:
        return 0.0
    return num_running * max(0.0, 1.0 - (at - now) / decode_duration)


def prefill_done_by(queued_requests: float, queue_time: float, dt: float) -> float:
    """Expected number of the requests queued on a prefill instance that finish within
    ``dt`` seconds. The queue drains at a steady rate over ``queue_time``:

        ``done = queued_requests * min(1, dt / queue_time)``   (all of it if queue_time = 0)
    """
    if queued_requests <= 0:
        return 0.0
    if queue_time <= 0:
        return float(queued_requests)
    return queued_requests * min(1.0, dt / queue_time)


def prefill_done_within(times: Sequence[float], dt: float) -> int:
    """How many requests of a prefill queue, served in order and each taking ``times[i]``
    seconds, have finished within ``dt``: the longest prefix whose sum is at most ``dt``."""
    spent = 0.0
    for k, t in enumerate(times):
        spent += t
        if spent > dt:
            return k
    return len(times)


def time_until_finished(
    k: int,
    num_running: int,
    finish_times: Sequence[float],
    now: float,
    decode_duration: float,
) -> float:
    """Seconds until ``k`` of the running decodes have finished (0 if ``k <= 0``).

    With ``finish_times``: the k-th earliest, minus ``now``. Without: uniform ages over
    t_d mean they finish at a steady rate of ``num_running / t_d``, so ``k / num_running * t_d``.
    More than are running: ``t_d`` (or the last finish time), a full turnover.
    """
    if k <= 0:
        return 0.0
    if finish_times:
        ordered = sorted(finish_times)
        return max(0.0, ordered[min(k, len(ordered)) - 1] - now)
    if num_running <= 0:
        return decode_duration
    return min(1.0, k / num_running) * decode_duration


def ttft_retry_after(predicted_ttft: float, ttft_slo: float) -> float:
    """A prefill queue drains at one second of work per second, so after the excess
    ``predicted_ttft - ttft_slo`` the same request would meet the SLO (absent new arrivals).
    """
    return max(0.0, predicted_ttft - ttft_slo)


def finishes_needed(
    fits: Callable[[int], bool],
    num_running: int,
) -> int | None:
    """Smallest ``k`` in ``0..num_running`` with ``fits(k)`` true, or None (monotone
    predicate: finishing more requests never hurts), by binary search."""
    if not fits(num_running):
        return None
    lo, hi = 0, num_running
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def blocks_per_request(used_blocks: int, num_running: int) -> int:
    """Average KV blocks a running decode holds (``ceil(used / running)``; 0 if idle)."""
    return math.ceil(used_blocks / num_running) if num_running > 0 else 0


class StepOverruns:
    """How far measured steps run over the model that priced them: measured / predicted
    seconds of the last ``window`` steps, each priced by the model in force when it was
    measured. ``margin(quantile)`` is that quantile of the ratios, at least 1.0 (1.0 until
    ``min_steps`` were measured). Steps slower than the model (a loaded host) push it up
    before a refit moves the model, and it stays up for ``window`` steps after."""

    def __init__(self, window: int = 64, min_steps: int = 8) -> None:
        if window < 1 or min_steps < 1:
            raise ValueError("window and min_steps must be at least 1")
        self.ratios: deque[float] = deque(maxlen=window)
        self.min_steps = min_steps

    def add(self, measured: float, predicted: float) -> None:
        if measured > 0 and predicted > 0:
            self.ratios.append(measured / predicted)

    def margin(self, quantile: float) -> float:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be in [0, 1]")
        if len(self.ratios) < self.min_steps:
            return 1.0
        s = sorted(self.ratios)
        return max(1.0, s[min(len(s) - 1, int(quantile * len(s)))])


# -- TTFT early rejection: one rule for the Conductor and a colocated replica ---------------


def predict_ttft(queue_time: float, prefill_time: float) -> float:
    """Predicted TTFT: the time the work queued ahead takes, plus the request's own prefill."""
    return queue_time + prefill_time


@dataclass(frozen=True)
class TTFTJudgement:
    """Early rejection on TTFT (Mooncake): ``load = predicted_ttft / ttft_slo``; the request
    misses its SLO when ``load > 1``, and then ``retry_after`` is ``ttft_retry_after`` (the
    excess over the SLO: the queue drains one second of work per second); 0 otherwise."""

    predicted_ttft: float
    load: float
    retry_after: float

    @property
    def meets_slo(self) -> bool:
        return self.load <= 1


def judge_ttft(predicted_ttft: float, ttft_slo: float) -> TTFTJudgement:
    """The one TTFT rule: the Conductor's early rejection and a colocated replica's
    admission both call it."""
    if ttft_slo <= 0:
        raise ValueError("ttft_slo must be positive")
    load = predicted_ttft / ttft_slo
    retry = ttft_retry_after(predicted_ttft, ttft_slo) if load > 1 else 0.0
    return TTFTJudgement(predicted_ttft, load, retry)


def retry_after_at_least(seconds: float, min_retry_after: float) -> float:
    """The Retry-After a refusal reports: ``seconds``, never below ``min_retry_after``."""
    return max(min_retry_after, seconds)


# -- a colocated replica's predicted TTFT --------------------------------------------------


@dataclass(frozen=True)
class QueuedPrompt:
    """A request whose prompt is not fully computed, in the order the scheduler serves it
    (running prefills first, then the waiting queue)."""

    new_tokens: int  # prompt tokens still to compute
    context_tokens: int  # tokens already computed (a cached prefix, earlier chunks)
    max_tokens: int  # tokens it generates: it joins the decode batch for max_tokens - 1 steps
    running: bool = False  # already holds a running slot (max_num_seqs)


@dataclass(frozen=True)
class RunningDecode:
    remaining: int  # tokens it may still generate (it stops at max_tokens, or earlier)
    context_tokens: int


@dataclass(frozen=True)
class ColocatedLoad:
    """What a colocated replica holds when a request arrives (exact on its engine thread)."""

    prompts: Sequence[QueuedPrompt]
    decodes: Sequence[RunningDecode]
    token_budget: int
    max_num_seqs: int
    chunk_size: int | None = None


class _StepCost(Protocol):
    base: float
    per_new_token: float
    per_cached_token: float
    per_attention_pair: float


def colocated_ttft(
    step_cost: _StepCost,
    load: ColocatedLoad,
    new_tokens: int,
    context_tokens: int,
    give_up_after: float = math.inf,
) -> tuple[float, float]:
    """(queue time, own prefill time) of a request arriving at a colocated replica.

    Its steps run every running decode (one token each, first) and fill the rest of
    ``token_budget`` with prompt chunks in FCFS order (at most ``chunk_size`` tokens of a
    request per step; a waiting request starts only while fewer than ``max_num_seqs``
    run). Each step costs ``step_cost`` of its entries, a decode counting as a one-token
    chunk: ``base + per_new_token * new + per_cached_token * context + per_attention_pair *
    pairs`` (the fitted ``pd_costs.LinearPrefillTime`` of measured steps). A decode ends
    after its ``remaining`` tokens (an upper bound: EOS may end it sooner); a prompt
    finished ahead of this one joins the decode batch. Queue time: the steps before the
    request's first chunk; own time: the steps from there to its last. The walk stops once
    the queue time passes ``give_up_after`` (the result is then a lower bound).
    """
    ends = sorted((d.remaining, d.context_tokens) for d in load.decodes)
    alive_ctx = sum(c for _, c in ends)
    gone = 0  # decodes in ``ends`` that have finished
    joined: list[tuple[int, int]] = []  # (step it ends after, context) of prompts done ahead
    joined_ctx = 0
    queue = [[p.new_tokens, p.context_tokens, p.max_tokens, p.running] for p in load.prompts]
    own = [max(1, new_tokens), context_tokens, 1, False]
    queue.append(own)
    running_prompts = sum(1 for p in load.prompts if p.running)
    cap = load.chunk_size or load.token_budget
    elapsed, started_at, step = 0.0, -1.0, 0
    while True:
        while gone < len(ends) and ends[gone][0] <= step:
            alive_ctx -= ends[gone][1]
            gone += 1
        while joined and joined[0][0] <= step:
            joined_ctx -= heapq.heappop(joined)[1]
        decodes = len(ends) - gone + len(joined)
        context = alive_ctx + joined_ctx
        new, pairs = float(decodes), float(decodes + context)
        room = load.token_budget - decodes
        finished = []
        for item in queue:
            if room <= 0:
                break
            if not item[3]:
                if decodes + running_prompts >= load.max_num_seqs:
                    break  # strict FCFS: the first that cannot start blocks the rest
                item[3] = True
                running_prompts += 1
            if item is own and started_at < 0:
                started_at = elapsed
            take = min(item[0], room, cap)
            new += take
            context += item[1]
            pairs += take * (take + item[1])
            item[0] -= take
            item[1] += take
            room -= take
            if item[0] == 0:
                finished.append(item)
        elapsed += (
            step_cost.base
            + step_cost.per_new_token * new
            + step_cost.per_cached_token * context
            + step_cost.per_attention_pair * pairs
        )
        step += 1
        if own[0] == 0:
            return started_at, elapsed - started_at
        if finished:
            queue = [item for item in queue if item[0] > 0]
        for item in finished:
            running_prompts -= 1
            if item[2] > 1:  # it samples its first token now, then decodes
                heapq.heappush(joined, (step + item[2] - 1, item[1]))
                joined_ctx += item[1]
        if (started_at < 0 and elapsed > give_up_after) or step >= _MAX_STEPS:
            return elapsed, 0.0


_MAX_STEPS = 100_000  # a walk that never reaches the request (a zero-cost fit) ends here


class ColocatedAdmission:
    """A colocated replica's TTFT admission: ``colocated_ttft`` judged by ``judge_ttft``
    against ``ttft_slo``. ``prefill_time`` is the step-cost model (``CostFitter.refit``
    replaces it as measured steps arrive); until there is one, every request is admitted."""

    def __init__(
        self,
        ttft_slo: float,
        min_retry_after: float = 1.0,
        prefill_time: _StepCost | None = None,
        error_quantile: float = 0.99,
        window: int = 128,
    ) -> None:
        if ttft_slo <= 0:
            raise ValueError("ttft_slo must be positive")
        if not 0 < error_quantile <= 1 or window < 1:
            raise ValueError("need 0 < error_quantile <= 1 and window >= 1")
        self.ttft_slo = ttft_slo
        self.min_retry_after = min_retry_after
        self.prefill_time = prefill_time
        self.error_quantile = error_quantile
        self._ratios: deque[float] = deque(maxlen=window)

    def observe(self, predicted_ttft: float, actual_ttft: float) -> None:
        """An admitted request's first token came ``actual_ttft`` after the arrival that
        was predicted to take ``predicted_ttft``: the prediction's error, measured."""
        if predicted_ttft > 0 and actual_ttft >= 0:
            self._ratios.append(actual_ttft / predicted_ttft)

    @property
    def correction(self) -> float:
        """Predictions are scaled by the ``error_quantile`` of measured actual / predicted
        TTFT over the last ``window`` admitted requests (1 before any): so admitted
        requests meet the SLO at that quantile even where the step-cost model is biased
        (overhead between steps it does not see, decodes that stop early)."""
        if not self._ratios:
            return 1.0
        ordered = sorted(self._ratios)
        return ordered[min(len(ordered) - 1, int(self.error_quantile * len(ordered)))]

    def judge(
        self, load: ColocatedLoad, new_tokens: int, context_tokens: int, waited: float = 0.0
    ) -> TTFTJudgement | None:
        """The judgement of a request with ``new_tokens`` to compute after
        ``context_tokens`` cached ones, that has already waited ``waited`` seconds for this
        decision (part of its queue time); its ``retry_after`` floored at
        ``min_retry_after`` when it misses the SLO. None: admit without a prediction.

        Until there is a step-cost model (no steps measured yet), a request is admitted
        when no prompt is queued ahead of it, and refused (``min_retry_after``) otherwise:
        a replica's first steps train the model instead of admitting a burst blind."""
        if self.prefill_time is None:
            if not load.prompts:
                return None
            return TTFTJudgement(math.inf, math.inf, self.min_retry_after)
        queue, own = colocated_ttft(
            self.prefill_time, load, new_tokens, context_tokens, give_up_after=2 * self.ttft_slo
        )
        j = judge_ttft(predict_ttft(waited + queue, own) * self.correction, self.ttft_slo)
        if j.meets_slo:
            return j
        return TTFTJudgement(
            j.predicted_ttft, j.load, retry_after_at_least(j.retry_after, self.min_retry_after)
        )
