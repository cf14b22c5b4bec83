"""Deployment plan of a dense model for a trace: a colocated group of ``tp x spp x kvp``
replicas, or a prefill/decode disaggregated group (P/D ratio and each side's ``tp x spp``),
whichever the roofline cost model (``placement.cost_model``) says is cheapest while the
trace's arrival rate meets the TTFT and TPOT SLOs.

The trace enters only through ``TraceStats`` (rate, prompt-length quantiles, mean output,
longest request). Per candidate layout the model is queueing-light and closed-form:

- prefill-only instances (P/D): ``rho = rate_per_instance * E[prefill time alone]`` (the
  mean over the prompt quantiles, chunks of ``CHUNK`` tokens overlapping across ``spp``
  stages) is the busy share; the p90 prompt's TTFT is its prefill alone inflated by
  ``1 / (1 - rho)`` (waiting behind others); it must meet the TTFT SLO, and
  ``rho <= max_util``;
- colocated replicas: the same with the chunks run one after another (each step also
  decodes, so it waits for its outputs and stages do not overlap); while prefills keep a
  replica busy, every step carries a chunk, so TPOT is the decode step plus a chunk step
  when that is more than ``1 - target`` of the time, else the time-share mean gap;
- decode: by Little's law an instance decodes ``D = rate_per_instance * E[output] * TPOT``
  requests at once, TPOT being one decode iteration of ``D`` requests of mean context; a
  decode instance runs at most the largest batch meeting the TPOT SLO;
- memory: the longest request fits an instance, and the requests it holds (P/D decode:
  from arrival, when the Conductor reserves their KV, to their last token) stay within its
  KV with a Poisson margin (``_Side.most_held``).

Colocated: the fewest replicas meeting both (binary search; both sides improve with more).
P/D: the fewest prefill instances for the TTFT side and the fewest decode instances for the
TPOT side, each side's layout chosen independently (P/D replicas take ``tp x spp``, no
``kvp``, as ``actors.serving.config.PDLayoutConfig`` does). The objective is the total
relative price (``GPUSpec.price``); ties go to fewer GPUs, then to colocated.
``sim.plan_replay`` replays the trace on the plan to check these predictions.

Pure code: no torch, no Ray, no files.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from placement.cost_model import RooflineCostModel, decode_time, prefill_time
from placement.model_specs import ModelSpec
from placement.moe_plan import Hardware, tp_choices

CHUNK = 2048  # prefill chunk tokens (the engine's default token budget)
SPP_CHOICES = (1, 2, 4)
KVP_CHOICES = (1, 2, 4)
QUANTILES = 32  # prompt-length quantile points kept from a trace
MAX_INSTANCES = 1 << 16


@dataclass(frozen=True)
class TraceStats:
    """What the planner needs of a trace. ``input_quantiles``: sorted prompt lengths at
    evenly spaced quantiles (their mean stands for the trace's mean prefill work)."""

    rate: float  # requests per second
    input_quantiles: tuple[int, ...]
    mean_output: float
    max_tokens: int  # the longest request's prompt + output

    @property
    def p90_input(self) -> int:
        q = self.input_quantiles
        return q[min(len(q) - 1, math.ceil(0.9 * len(q)) - 1)]

    @property
    def mean_total(self) -> int | float:
        """Mean tokens of a whole request (the KV it holds at its end)."""
        q = self.input_quantiles
        return sum(q) / len(q) + self.mean_output

    @property
    def mean_context(self) -> float:
        """Mean KV tokens of a decoding request: its prompt plus half its output."""
        q = self.input_quantiles
        return sum(q) / len(q) + self.mean_output / 2


def trace_stats(requests: Iterable[tuple[float, int, int]]) -> TraceStats:
    """From ``(arrival seconds, input_len, output_len)`` triples. The rate is the requests
    over the span of their arrivals; a trace of one request, or whose requests all arrive at
    one instant, gives no span and is taken as one request per second."""
    rows = sorted(requests)
    if not rows:
        raise ValueError("the trace holds no requests")
    span = rows[-1][0] - rows[0][0]
    rate = (len(rows) - 1) / span if span > 0 and len(rows) > 1 else 1.0
    inputs = sorted(r[1] for r in rows)
    n = len(inputs)
    points = min(QUANTILES, n)
    quant = tuple(inputs[min(n - 1, (2 * i + 1) * n // (2 * points))] for i in range(points))
    return TraceStats(
        rate=rate,
        input_quantiles=quant,
        mean_output=sum(r[2] for r in rows) / n,
        max_tokens=max(r[1] + r[2] for r in rows),
    )


@dataclass(frozen=True)
class DenseSLO:
    ttft_s: float = 30.0
    tpot_s: float = 0.150
    max_util: float = 0.8  # most busy share of a prefill side
    target: float = 0.9  # share of requests the SLOs are for

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0 or not 0 < self.max_util < 1:
            raise ValueError("SLOs must be positive and max_util in (0, 1)")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    spp: int = 1
    kvp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.spp * self.kvp

    def __str__(self) -> str:
        return f"tp {self.tp} x spp {self.spp} x kvp {self.kvp}"


@dataclass(frozen=True)
class DensePlan:
    """``mode`` "colocated": ``replicas`` of ``layout``; "pd": ``num_prefill`` instances of
    ``prefill`` and ``num_decode`` of ``decode``. Predicted p90 TTFT and mean TPOT."""

    model: str
    gpu: str
    mode: str
    cost: float
    gpus: int
    ttft_p90: float
    tpot: float
    layout: Layout | None = None
    replicas: int = 0
    prefill: Layout | None = None
    num_prefill: int = 0
    decode: Layout | None = None
    num_decode: int = 0

    @property
    def prefill_share(self) -> float:
        """Share of the GPUs that prefill only (0 for colocated)."""
        if self.mode != "pd" or self.prefill is None:
            return 0.0
        return self.num_prefill * self.prefill.gpus / self.gpus

    def describe(self) -> str:
        if self.mode == "colocated":
            what = f"colocated: {self.replicas} replica(s) of {self.layout}"
        else:
            what = (
                f"P/D: {self.num_prefill} prefill of {self.prefill} : {self.num_decode} "
                f"decode of {self.decode} (prefill share {self.prefill_share:.0%} of GPUs)"
            )
        return f"{what} on {self.gpu}, {self.gpus} GPUs, cost {self.cost:g}"


def _cost_model(model: ModelSpec, hw: Hardware, layout: Layout) -> RooflineCostModel | None:
    cost = RooflineCostModel(model, hw.gpu, tp=layout.tp, spp=layout.spp, kvp=layout.kvp)
    try:
        cost.kv_capacity_tokens()
    except ValueError:  # the weights do not fit one stage
        return None
    return cost


@dataclass(frozen=True)
class _Side:
    """One layout's per-instance numbers that do not depend on the instance count.
    ``mean_prefill`` / ``p90_prefill``: a prompt alone on a prefill-only instance (chunks
    overlap across ``spp`` stages); ``serial_*``: the same chunks one after another, as on a
    colocated replica, whose steps also carry decodes (each waits for its outputs);
    ``chunk_time``: a prefill chunk step's mean duration, weighted by time."""

    layout: Layout
    cost: RooflineCostModel
    capacity: int  # KV tokens
    mean_prefill: float  # seconds, mean over the prompt quantiles
    p90_prefill: float
    serial_mean: float
    serial_p90: float
    chunk_time: float

    @classmethod
    def of(cls, model: ModelSpec, hw: Hardware, layout: Layout, t: TraceStats) -> _Side | None:
        cost = _cost_model(model, hw, layout)
        if cost is None or cost.kv_capacity_tokens() < t.max_tokens:
            return None
        times = [prefill_time(cost, n, 0, CHUNK) for n in t.input_quantiles]
        chunks = [_chunk_times(cost, n) for n in t.input_quantiles]
        serial = [sum(c) for c in chunks]
        return cls(
            layout,
            cost,
            cost.kv_capacity_tokens(),
            sum(times) / len(times),
            prefill_time(cost, t.p90_input, 0, CHUNK),
            sum(serial) / len(serial),
            sum(_chunk_times(cost, t.p90_input)),
            sum(x * x for c in chunks for x in c) / sum(serial),
        )

    def most_held(self, t: TraceStats) -> float:
        """The most requests an instance may hold on average: ``k`` whole mean requests
        fit its KV, and the count held at once (Poisson, mean ``x``) stays within ``k`` at
        ``x + 2 sqrt(x) <= k`` (about 97% of the time)."""
        k = self.capacity / t.mean_total
        return (math.sqrt(1 + k) - 1) ** 2

    def decode(self, batch: float, t: TraceStats) -> float:
        b = max(1, math.ceil(batch))
        return decode_time(self.cost, b, int(b * t.mean_context))


def _chunk_times(cost: RooflineCostModel, prompt: int) -> list[float]:
    return [cost.batch_time([(min(CHUNK, prompt - d), d)]) for d in range(0, prompt, CHUNK)]


def _colocated_tpot(side: _Side, rate: float, t: TraceStats, slo: DenseSLO) -> float | None:
    """TPOT of one colocated replica at ``rate`` requests/s, or None if none is stable. While
    prefills keep it busy (a share ``rho`` of the time) every step also computes a prefill
    chunk; when that is more than ``1 - target`` of the time, the p90 request decodes beside
    chunks throughout (TPOT = chunk + decode step), else the mean gap of the time share."""
    rho = rate * side.serial_mean
    if rho >= slo.max_util:
        return None

    def gap(t_d: float) -> float:
        if rho > 1 - slo.target:
            return side.chunk_time + t_d
        return 1 / (rho / (side.chunk_time + t_d) + (1 - rho) / t_d)

    tpot = gap(side.decode(1, t))
    for _ in range(100):  # monotone from below: converges to the least fixed point
        batch = rate * t.mean_output * tpot
        held = rate * (side.serial_mean / (1 - rho) + t.mean_output * tpot)
        if held > side.most_held(t):
            return None
        nxt = gap(side.decode(batch, t))
        if nxt > 10 * slo.tpot_s:
            return None
        if abs(nxt - tpot) <= 1e-9 * tpot:
            return nxt
        tpot = nxt
    return tpot


def _colocated(
    model: ModelSpec, hw: Hardware, side: _Side, t: TraceStats, slo: DenseSLO
) -> DensePlan | None:
    def ok(n: int) -> tuple[float, float] | None:
        rate = t.rate / n
        rho = rate * side.serial_mean
        if rho >= slo.max_util:
            return None
        ttft = side.serial_p90 / (1 - rho)
        tpot = _colocated_tpot(side, rate, t, slo)
        if tpot is None or tpot > slo.tpot_s or ttft > slo.ttft_s:
            return None
        return ttft, tpot

    if side.serial_p90 > slo.ttft_s or ok(MAX_INSTANCES) is None:
        return None
    lo, hi = 1, MAX_INSTANCES
    while lo < hi:  # invariant: ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) is not None else (mid + 1, hi)
    found = ok(lo)
    assert found is not None
    gpus = lo * side.layout.gpus
    return DensePlan(
        model.name,
        hw.gpu.name,
        "colocated",
        gpus * hw.gpu.price,
        gpus,
        found[0],
        found[1],
        layout=side.layout,
        replicas=lo,
    )


def _prefill_side(side: _Side, t: TraceStats, slo: DenseSLO) -> tuple[int, float, float] | None:
    """The fewest prefill instances, the p90 TTFT they give and the mean TTFT."""
    if side.p90_prefill >= slo.ttft_s:
        return None
    util = min(slo.max_util, 1 - side.p90_prefill / slo.ttft_s)
    n = max(1, math.ceil(t.rate * side.mean_prefill / util - 1e-12))
    rho = t.rate * side.mean_prefill / n
    return n, side.p90_prefill / (1 - rho), side.mean_prefill / (1 - rho)


def _decode_side(
    side: _Side, t: TraceStats, slo: DenseSLO, hold_s: float
) -> tuple[int, float] | None:
    """The fewest decode instances and their TPOT: each runs at most the largest batch
    whose iteration meets the TPOT SLO and whose mean contexts fit its KV, and holds the
    KV of the requests assigned to it, from arrival (the Conductor reserves it then: a mean
    TTFT of ``hold_s``) to their last token, within ``max_util`` of its capacity."""
    if side.decode(1, t) > slo.tpot_s:
        return None
    cap = max(1, int(side.capacity // t.mean_context))
    lo, hi = 1, cap
    while lo < hi:  # invariant: decode(lo) <= SLO
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if side.decode(mid, t) <= slo.tpot_s else (lo, mid - 1)
    tpot = side.decode(lo, t)
    held = t.rate * (hold_s + t.mean_output * tpot)
    n = max(
        1,
        math.ceil(t.rate * t.mean_output * tpot / lo - 1e-12),
        math.ceil(held / side.most_held(t) - 1e-12),
    )
    return n, side.decode(t.rate * t.mean_output * tpot / n, t)


def layouts(hw: Hardware, kvp: bool = True) -> list[Layout]:
    kvps = KVP_CHOICES if kvp else (1,)
    return [
        Layout(tp, spp, k)
        for tp in tp_choices(hw.gpus_per_node)
        for spp in SPP_CHOICES
        for k in kvps
    ]


def _pd(
    model: ModelSpec, hw: Hardware, sides: Sequence[_Side], t: TraceStats, slo: DenseSLO
) -> DensePlan | None:
    """The cheapest P/D group: the prefill layout first (its mean TTFT is how long the
    decode side holds a request's KV before its first token), then the decode layout."""
    sides = [s for s in sides if s.layout.kvp == 1]
    pre = [(s, r) for s in sides if (r := _prefill_side(s, t, slo)) is not None]
    if not pre:
        return None
    p_side, (n_p, ttft, hold) = min(pre, key=lambda x: x[1][0] * x[0].layout.gpus)
    dec = [(s, d) for s in sides if (d := _decode_side(s, t, slo, hold)) is not None]
    if not dec:
        return None
    d_side, (n_d, tpot) = min(dec, key=lambda x: x[1][0] * x[0].layout.gpus)
    gpus = n_p * p_side.layout.gpus + n_d * d_side.layout.gpus
    return DensePlan(
        model.name,
        hw.gpu.name,
        "pd",
        gpus * hw.gpu.price,
        gpus,
        ttft,
        tpot,
        prefill=p_side.layout,
        num_prefill=n_p,
        decode=d_side.layout,
        num_decode=n_d,
    )


def _key(plan: DensePlan) -> tuple[float, int, int]:
    return (plan.cost, plan.gpus, 0 if plan.mode == "colocated" else 1)


def search_dense_plan(
    model: ModelSpec,
    hardware: Sequence[Hardware],
    trace: TraceStats,
    slo: DenseSLO = DenseSLO(),
    modes: Sequence[str] = ("colocated", "pd"),
) -> DensePlan:
    """The cheapest plan over every GPU type, layout and mode (see the module docstring)."""
    if model.is_moe:
        raise ValueError(f"{model.name} is MoE: plan it with placement.moe_plan")
    if not hardware:
        raise ValueError("give at least one hardware type")
    best: DensePlan | None = None
    for hw in hardware:
        sides = [s for lay in layouts(hw) if (s := _Side.of(model, hw, lay, trace)) is not None]
        candidates: list[DensePlan] = []
        if "colocated" in modes:
            candidates += [p for s in sides if (p := _colocated(model, hw, s, trace, slo))]
        if "pd" in modes and (pd := _pd(model, hw, sides, trace, slo)) is not None:
            candidates.append(pd)
        for plan in candidates:
            if best is None or _key(plan) < _key(best):
                best = plan
    if best is None:
        raise ValueError(
            f"no layout of {model.name} on {', '.join(h.gpu.name for h in hardware)} meets "
            f"TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s * 1e3:g} ms for this trace "
            f"(longest request {trace.max_tokens} tokens): raise the SLOs or use larger GPUs"
        )
    return best
