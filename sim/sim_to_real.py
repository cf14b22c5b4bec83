"""Sim-to-real: replay a trace slice on the live CPU engine (the tiny model on
``actors.engine.replica_controller.ReplicaController``) and in the simulator, and compare
per-request TTFT and TPOT, for every trace.

One repeat of one trace, on a fresh engine:

1. Warm-up (untimed): every step shape the replay can produce runs once (``shape_sweep``:
   every token count 1..budget, every decode batch 1..max_num_seqs), so oneDNN's kernels
   for every row count exist before anything is timed.
2. Calibration, independent of every trace: a timed pass of the same sweep and of the step
   grid (``sim.step_grid``: prefill chunks at cached offsets, decode batches at several
   contexts, chunks riding with decodes) just before the replay, and the grid again just
   after it, so the fit brackets the replay in time (the shared machine's speed drifts
   over minutes). Each iteration's batch ``(new tokens, context)`` is read from the
   engine's own scheduler step, its time is its *period* (the clock's advance since the
   previous iteration ended, so admitting requests and the loop count, as in the replay).
   The replica's runtime predictor (``placement.runtime_predictor.RuntimePredictor``) is
   fitted from those steps by the fitter it refits with online
   (``policies.pd_costs.fit_prefill_time``: base + new tokens + context + attention pairs
   + requests, non-negative least squares on relative residuals, the worst 10% of steps
   trimmed). ``SplitFittedCostModel`` is fitted on the same steps for comparison.
3. Evaluation (held out: no step of any trace is in the fit): the trace's first ``n``
   requests replayed live ``passes`` times on that engine (per request, the median over
   passes: a light trace's replay lasts a fraction of a second, so one burst of load on
   the shared cores would otherwise decide it); its first and last token's times.
4. The same requests simulated (same token ids, same scheduler settings, one colocated
   instance timed by the fitted predictor); median relative errors over requests.

Both replays shrink lengths to the tiny model's 2k context (hash-id blocks become 32-token
blocks, so prefix sharing survives) and keep the trace's arrival gaps stretched by
``arrival_scale`` (1.5: a moderately loaded engine, so the comparison is not dominated by
queueing). Torch runs with one intra-op thread (``torch.set_num_threads(1)``): on this
2-core machine that makes step times stable, and the fit is of that configuration.
``repeats`` repeats per trace (the traces interleaved) give medians and the spread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from placement.cost_model import CostModel
from placement.fitted import SplitFittedCostModel
from policies.routing import RoundRobin
from sim.cluster import InstanceSpec
from sim.colocated import ColocatedCluster
from sim.metrics import percentile
from sim.step_grid import run_step_grid
from sim.traces import load_trace
from sim.workload import TraceRequest

BLOCK = 16
NUM_BLOCKS = 2048
BUDGET = 256
MAX_SEQS = 32
VOCAB = 509  # a prime below the tiny model's 512


def tiny_tokens(req: TraceRequest, index: int) -> list[int]:
    """Each hash id -> a fixed block ``[a, b, 0, 0, ...]`` inside the tiny vocabulary."""
    bs = req.trace_block_size
    out: list[int] = []
    ids = req.hash_ids if req.hash_ids is not None else (10_000_000 + index,)
    for h in ids:
        out += [1 + h % VOCAB, 1 + (h // VOCAB) % VOCAB] + [0] * (bs - 2)
    out = out[: req.input_len]
    return out + [0] * (req.input_len - len(out))


def shrink(reqs: list[TraceRequest], arrival_scale: float) -> list[TraceRequest]:
    out = []
    for r in reqs:
        out.append(
            TraceRequest(
                r.request_id,
                r.arrival * arrival_scale,
                max(16, min(1000, r.input_len // 16)),
                max(2, min(32, r.output_len // 16)),
                r.hash_ids,
                trace_block_size=32,
            )
        )
    return out


class _Recorder:
    """Wraps the engine's scheduler ``schedule`` to see each step's batch and sequences."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seqs: dict[str, Any] = {}
        self.last: list[tuple[int, int]] = []
        self.last_seqs: list[Any] = []
        orig = engine.scheduler.schedule

        def schedule(now: float) -> Any:
            step = orig(now)
            self.last = [(n, s.num_computed_tokens) for s, n in step.entries]
            self.last_seqs = [s for s, _ in step.entries]
            for s, _ in step.entries:
                self.seqs[s.request_id] = s
            return step

        engine.scheduler.schedule = schedule


def _add(engine: Any, prompt: list[int], params: Any, request_id: str) -> None:
    """Queue a request on ``engine``, built (checked and hashed) as the edge builds it."""
    engine.add_request(engine.request_builder().build(prompt, params, request_id=request_id))


def _engine() -> Any:
    from actors.engine.replica_controller import ReplicaController

    return ReplicaController.build(
        block_size=BLOCK, num_blocks=NUM_BLOCKS, token_budget=BUDGET, max_num_seqs=MAX_SEQS
    )


def _params(max_tokens: int) -> Any:
    from actors.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _pin_threads() -> None:
    import torch

    torch.set_num_threads(1)


class _Periods:
    """Each step's batch and *period*: the clock's advance from the previous step's end to
    this one's, so the work between steps (admitting requests, the loop) counts like the
    step it precedes, as it does in ``replay_live``."""

    def __init__(self, engine: Any, rec: _Recorder | None, tick: Any) -> None:
        self.engine, self.rec, self.tick = engine, rec, tick
        self.batches: list[list[tuple[int, int]]] = []
        self.secs: list[float] = []
        self.mark = tick()

    def step(self) -> list[tuple[int, int]]:
        """One engine step; its batch (empty when the engine had nothing to run)."""
        if not self.engine.has_unfinished():
            return []
        self.engine.step()
        now = self.tick()
        dt, self.mark = now - self.mark, now
        if self.rec is None:
            return [(0, 0)]  # untimed: only "not idle" matters
        batch, self.rec.last = self.rec.last, []
        if batch:
            self.batches.append(batch)
            self.secs.append(dt)
        return batch


def shape_sweep(
    engine: Any, tag: str, rec: _Recorder | None = None, tick: Any = time.thread_time
) -> tuple[list[list[tuple[int, int]]], list[float]]:
    """Run every step shape once: a prompt of each length 1..BUDGET alone (token counts),
    then b three-token prompts together for b in 1..MAX_SEQS (decode batches of b); then
    empty the prefix cache. With ``rec``, returns each step's batch and ``tick`` period."""
    timer = _Periods(engine, rec, tick)
    k = 0

    def drain() -> None:
        while timer.step():
            pass

    for t in range(1, BUDGET + 1):
        # Distinct first tokens: no sweep prompt hits another's cached prefix.
        prompt = [1 + (t * 31 + j) % (VOCAB - 1) for j in range(t)]
        _add(engine, prompt, _params(1), f"{tag}-{k}")
        k += 1
        drain()
    for b in range(1, MAX_SEQS + 1):
        for j in range(b):
            prompt = [1 + (b * 37 + j * 5 + i) % (VOCAB - 1) for i in range(3)]
            _add(engine, prompt, _params(3), f"{tag}-{k}")
            k += 1
        drain()
    _forget(engine, [f"{tag}-{i}" for i in range(k)], rec)
    return timer.batches, timer.secs


def _forget(engine: Any, ids: list[str], rec: _Recorder | None) -> None:
    """Release ``ids`` and empty the prefix cache, so the pool starts as the simulated one."""
    for rid in ids:
        engine.release(rid)
    pools = engine.scheduler.kv.pools  # a property now, a method in older trees
    for pool in pools() if callable(pools) else pools:
        pool.evict_all_cached()
    if rec is not None:
        rec.seqs.clear()


def timed_grid(
    engine: Any, tag: str, rec: _Recorder, tick: Any = time.thread_time
) -> tuple[list[list[tuple[int, int]]], list[float]]:
    """``sim.step_grid.run_step_grid`` on ``engine``: each step's batch and ``tick`` period."""
    timer = _Periods(engine, rec, tick)

    def submit(prompt: list[int], max_tokens: int, rid: str) -> None:
        _add(engine, prompt, _params(max_tokens), rid)

    _forget(engine, run_step_grid(submit, timer.step, tag, VOCAB), rec)
    return timer.batches, timer.secs


@dataclass
class Replay:
    """One live replay: per request (TTFT, TPOT) and per iteration its batch and period;
    with ``calibrate``, the calibration steps timed on the same engine around it."""

    live: dict[str, tuple[float, float]]
    batches: list[list[tuple[int, int]]]
    periods: list[float]
    cal_batches: list[list[tuple[int, int]]]
    cal_periods: list[float]


def replay_live(
    reqs: list[TraceRequest], clock: str = "cpu", calibrate: bool = False, passes: int = 1
) -> Replay:
    """Replay ``reqs`` on a fresh, warmed-up engine, ``passes`` times (the requests released
    and the prefix cache emptied between passes). Returns per request its median (TTFT,
    TPOT) over the passes (a short replay lasts a fraction of a second, so one burst of a
    co-tenant on the shared cores can slow all of one pass), and per iteration of every
    pass its batch and its period: the clock's advance from the previous iteration's end
    (or from the engine waking up) to this one's end, so the serving loop's own work
    (admitting arrivals, bookkeeping) counts like the step it precedes.

    ``clock="wall"``: arrivals are admitted in real time and every time is wall time
    (``perf_counter``). ``clock="cpu"``: the replay's timeline advances by this thread's CPU
    time while the engine works and jumps to the next arrival while it idles; arrivals are
    admitted when that timeline reaches them. The engine computes every step exactly as in
    real time; only time stolen by other processes on the shared cores is left out (with one
    torch thread, an uncontended engine's wall time equals its CPU time). Tokens are stamped
    at the end of the iteration that produced them, in both modes. ``calibrate``: also time
    a pass of ``shape_sweep`` and of the step grid (``sim.step_grid``) just before the
    replays, and the grid again just after them, on the same engine: ``cal_batches`` /
    ``cal_periods``, for the fit."""
    if clock not in ("cpu", "wall"):
        raise ValueError("clock must be 'cpu' or 'wall'")
    if passes < 1:
        raise ValueError("passes must be >= 1")
    _pin_threads()
    engine = _engine()
    shape_sweep(engine, "warmup")  # one-off kernel builds; not timed
    rec = _Recorder(engine)
    tick = time.thread_time if clock == "cpu" else time.perf_counter
    batches: list[list[tuple[int, int]]] = []
    periods: list[float] = []
    cal_batches: list[list[tuple[int, int]]] = []
    cal_periods: list[float] = []
    if calibrate:  # a second, warm pass over every shape, then the step grid, timed
        cal_batches, cal_periods = shape_sweep(engine, "sweep", rec, tick)
        grid_batches, grid_periods = timed_grid(engine, "grid", rec, tick)
        cal_batches, cal_periods = cal_batches + grid_batches, cal_periods + grid_periods
    per_pass: list[dict[str, tuple[float, float]]] = []
    for k in range(passes):
        tagged = [replace(r, request_id=f"{r.request_id}@{k}") for r in reqs]
        times = _replay_pass(engine, rec, tagged, clock, tick, batches, periods)
        per_pass.append(
            {r.request_id: times[t.request_id] for r, t in zip(reqs, tagged, strict=True)}
        )
        _forget(engine, [t.request_id for t in tagged], rec)
    out = {
        r.request_id: (
            statistics.median(p[r.request_id][0] for p in per_pass),
            statistics.median(p[r.request_id][1] for p in per_pass),
        )
        for r in reqs
    }
    if calibrate:  # the grid again, so the fit brackets the replays in time
        grid_batches, grid_periods = timed_grid(engine, "grid-after", rec, tick)
        cal_batches, cal_periods = cal_batches + grid_batches, cal_periods + grid_periods
    return Replay(out, batches, periods, cal_batches, cal_periods)


def _replay_pass(
    engine: Any,
    rec: _Recorder,
    reqs: list[TraceRequest],
    clock: str,
    tick: Any,
    batches: list[list[tuple[int, int]]],
    periods: list[float],
) -> dict[str, tuple[float, float]]:
    """One replay of ``reqs`` (see ``replay_live``); appends each iteration's batch and
    period to ``batches`` / ``periods``; returns per request (TTFT, TPOT)."""
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    t0 = time.perf_counter()
    vt = 0.0  # the replay's timeline, seconds since its start
    mark = tick()
    i = 0
    while i < len(reqs) or engine.has_unfinished():
        while i < len(reqs) and reqs[i].arrival <= vt:
            r = reqs[i]
            _add(engine, tiny_tokens(r, i), _params(r.output_len), r.request_id)
            i += 1
        if engine.has_unfinished():
            engine.step()
            now = tick()
            vt, dt, mark = vt + (now - mark), now - mark, now
            if rec.last:
                batches.append(rec.last)
                periods.append(dt)
            for seq in rec.last_seqs:
                rid = seq.request_id
                if rid not in first and seq.output_token_ids:
                    first[rid] = vt
                if seq.is_finished and rid not in finish:
                    finish[rid] = vt
            rec.last, rec.last_seqs = [], []
        elif i < len(reqs):  # idle until the next arrival
            if clock == "wall":
                time.sleep(max(0.0, reqs[i].arrival - (time.perf_counter() - t0)))
                vt = time.perf_counter() - t0
            else:
                vt = reqs[i].arrival
            mark = tick()
    out = {}
    for r in reqs:
        n = len(rec.seqs[r.request_id].output_token_ids)
        f = first[r.request_id]
        tpot = (finish[r.request_id] - f) / (n - 1) if n > 1 else 0.0
        out[r.request_id] = (f - r.arrival, tpot)
    return out


def replay_sim(reqs: list[TraceRequest], cost: CostModel) -> dict[str, tuple[float, float]]:
    spec = InstanceSpec(cost, NUM_BLOCKS, BLOCK, token_budget=BUDGET, max_num_seqs=MAX_SEQS)
    cluster = ColocatedCluster(1, spec, RoundRobin())
    cluster.token_fn = tiny_tokens
    stats = cluster.run(reqs)
    return {s.request_id: (s.ttft or 0.0, s.tpot or 0.0) for s in stats}


def _errors(
    live: dict[str, tuple[float, float]], pred: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Per-request relative errors of TTFT and TPOT (requests with one output token have
    no TPOT), summarised by median and p90, plus the medians themselves."""
    ttft = [abs(pred[k][0] - v[0]) / v[0] for k, v in live.items() if v[0] > 0]
    keys = [k for k, v in live.items() if v[1] > 0]
    tpot = [abs(pred[k][1] - live[k][1]) / live[k][1] for k in keys]
    return {
        "ttft_median_rel_err": statistics.median(ttft),
        "tpot_median_rel_err": statistics.median(tpot),
        "ttft_p90_rel_err": percentile(ttft, 90),
        "tpot_p90_rel_err": percentile(tpot, 90),
        "measured_ttft_median_s": statistics.median(v[0] for v in live.values()),
        "predicted_ttft_median_s": statistics.median(v[0] for v in pred.values()),
        "measured_tpot_median_s": statistics.median(live[k][1] for k in keys),
        "predicted_tpot_median_s": statistics.median(pred[k][1] for k in keys),
    }


def fit_runtime_predictor(batches: list[list[tuple[int, int]]], seconds: list[float]) -> Any:
    """The replica's own predictor (``placement.runtime_predictor.RuntimePredictor``), its
    step model fitted once from ``batches`` by the fitter it refits with online
    (``policies.pd_costs.fit_prefill_time``), trimming the worst-fitting 10% of steps."""
    from placement.runtime_predictor import RuntimePredictor

    pred = RuntimePredictor()
    pred.fit_steps(batches, seconds, trim=0.1)
    return pred


def one_repeat(reqs: list[TraceRequest], clock: str, passes: int = 5) -> dict[str, Any]:
    """One fresh engine: calibrate on the step grid around the replay of ``reqs`` (already
    shrunk), fit, simulate ``reqs``; no step of the trace is in the fit."""
    r = replay_live(reqs, clock, calibrate=True, passes=passes)
    fit = fit_runtime_predictor(r.cal_batches, r.cal_periods)
    split = SplitFittedCostModel.fit(r.cal_batches, r.cal_periods)
    steps = zip(r.batches, r.periods, strict=True)
    step_err = [abs(fit.batch_time(b) - t) / t for b, t in steps]
    split_err = _errors(r.live, replay_sim(reqs, split))
    return {
        "fit": fit.describe(),
        "calibration_steps": len(r.cal_batches),
        "heldout_steps": len(r.batches),
        "step_median_rel_err_heldout": statistics.median(step_err),
        **_errors(r.live, replay_sim(reqs, fit)),
        "split_ttft_median_rel_err": split_err["ttft_median_rel_err"],
        "split_tpot_median_rel_err": split_err["tpot_median_rel_err"],
    }


SUMMARY_KEYS = (
    "ttft_median_rel_err",
    "tpot_median_rel_err",
    "split_ttft_median_rel_err",
    "split_tpot_median_rel_err",
    "step_median_rel_err_heldout",
)


def run_sim_to_real(
    traces: list[str],
    trace_dir: str | None = None,
    n: int = 40,
    arrival_scale: float = 1.5,
    repeats: int = 3,
    clock: str = "cpu",
    log: Any = None,
    passes: int = 5,
) -> dict[str, Any]:
    """Evaluate the first ``n`` requests of each trace, ``repeats`` times, the traces
    interleaved (repeat 1 of every trace, then repeat 2 ...) so the machine's load drifts
    over all of them alike. Per trace: the median (min, max) over repeats of each error."""
    if repeats < 1 or n < 2:
        raise ValueError("need repeats >= 1 and at least 2 requests")
    slices = {name: shrink(load_trace(name, trace_dir, limit=n), arrival_scale) for name in traces}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in traces}
    for k in range(repeats):
        for name in traces:
            t0 = time.perf_counter()
            runs[name].append(one_repeat(slices[name], clock, passes))
            if log is not None:
                last = runs[name][-1]
                log(
                    f"{name} repeat {k + 1}: TTFT err {last['ttft_median_rel_err']:.3f} "
                    f"TPOT err {last['tpot_median_rel_err']:.3f} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    out: dict[str, Any] = {}
    for name in traces:
        out[name] = {"requests": len(slices[name]), "runs": runs[name]}
        out[name] |= {key: spread([r[key] for r in runs[name]]) for key in SUMMARY_KEYS}
    return {
        "format": 2,
        "requests": n,
        "arrival_scale": arrival_scale,
        "torch_threads": 1,
        "clock": clock,
        "repeats": repeats,
        "passes": passes,
        "traces": out,
    }
