"""Sim-to-real: replay a trace slice on the live CPU engine (``actors.engine.Engine``, the
tiny model) and in the simulator, and compare per-request TTFT and TPOT.

1. Calibrate (offline data, as Mooncake's predictor is fitted): run a separate random mix
   on the engine, recording each iteration's batch ``(new tokens, cached context)`` (read
   from the engine's own scheduler step) and its wall time; fit ``FittedCostModel``.
2. Replay: a slice of the trace, lengths shrunk to the tiny model's 2k context (hash-id
   blocks become 32-token blocks, so prefix sharing survives), arrivals compressed; the
   engine runs in real time and each ``Sequence`` records ``first_token_time`` and
   ``finish_time`` from ``time.monotonic()``.
3. Simulate the same requests, same token ids, same scheduler settings, on one colocated
   instance timed by the fitted model; report median relative errors.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from placement.fitted import FittedCostModel
from policies.routing import RoundRobin
from sim.cluster import InstanceSpec
from sim.colocated import ColocatedCluster
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
        orig = engine.scheduler.schedule

        def schedule(now: float) -> Any:
            step = orig(now)
            self.last = [(n, s.num_computed_tokens) for s, n in step.entries]
            for s, _ in step.entries:
                self.seqs[s.request_id] = s
            return step

        engine.scheduler.schedule = schedule

    def timed_step(self) -> tuple[list[tuple[int, int]], float]:
        t0 = time.perf_counter()
        self.engine.step()
        return self.last, time.perf_counter() - t0


def _engine() -> Any:
    from actors.engine import Engine

    return Engine(
        block_size=BLOCK, num_blocks=NUM_BLOCKS, token_budget=BUDGET, max_num_seqs=MAX_SEQS
    )


def _params(max_tokens: int) -> Any:
    from actors.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def calibrate(seed: int, rounds: int = 6) -> tuple[FittedCostModel, dict[str, float]]:
    engine = _engine()
    rec = _Recorder(engine)
    rng = random.Random(seed)
    batches, secs = [], []
    for k in range(rounds):
        for j in range(rng.randint(2, 12)):
            n = rng.choice([16, 48, 128, 256, 512, 900])
            toks = [rng.randrange(1, 500) for _ in range(n)]
            engine.add_request(toks, _params(rng.randint(2, 40)), request_id=f"cal{k}-{j}")
        while engine.has_unfinished():
            batch, dt = rec.timed_step()
            if batch:
                batches.append(batch)
                secs.append(dt)
    warm = len(batches) // 10  # first iterations pay one-off warm-up costs
    fit = FittedCostModel.fit(batches[warm:], secs[warm:])
    errs = [
        abs(fit.batch_time(b) - s) / s for b, s in zip(batches[warm:], secs[warm:], strict=True)
    ]
    return fit, {
        "calibration_steps": len(batches) - warm,
        "step_median_rel_err": statistics.median(errs),
    }


def replay_live(reqs: list[TraceRequest]) -> dict[str, tuple[float, float]]:
    engine = _engine()
    rec = _Recorder(engine)
    t0 = time.monotonic()
    i = 0
    while i < len(reqs) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(reqs) and reqs[i].arrival <= now:
            r = reqs[i]
            engine.add_request(
                tiny_tokens(r, i), _params(r.output_len), request_id=r.request_id,
                arrival_time=t0 + r.arrival,
            )  # fmt: skip
            i += 1
        if engine.has_unfinished():
            rec.timed_step()
        elif i < len(reqs):
            time.sleep(max(0.0, reqs[i].arrival - (time.monotonic() - t0)))
    out = {}
    for r in reqs:
        s = rec.seqs[r.request_id]
        ttft = s.first_token_time - s.arrival_time
        n = len(s.output_token_ids)
        tpot = (s.finish_time - s.first_token_time) / (n - 1) if n > 1 else 0.0
        out[r.request_id] = (ttft, tpot)
    return out


def replay_sim(reqs: list[TraceRequest], cost: FittedCostModel) -> dict[str, tuple[float, float]]:
    spec = InstanceSpec(cost, NUM_BLOCKS, BLOCK, token_budget=BUDGET, max_num_seqs=MAX_SEQS)
    cluster = ColocatedCluster(1, spec, RoundRobin())
    cluster.token_fn = tiny_tokens
    stats = cluster.run(reqs)
    return {s.request_id: (s.ttft or 0.0, s.tpot or 0.0) for s in stats}


def run_sim_to_real(
    trace: str = "conversation", trace_dir: str | None = None, n: int = 40, seed: int = 0
) -> dict[str, Any]:
    fit, cal = calibrate(seed)
    reqs = shrink(load_trace(trace, trace_dir, limit=n), arrival_scale=0.05)
    live = replay_live(reqs)
    pred = replay_sim(reqs, fit)

    def rel(i: int) -> list[float]:
        return [abs(pred[k][i] - live[k][i]) / live[k][i] for k in live if live[k][i] > 0]

    ttft_err, tpot_err = rel(0), rel(1)
    return {
        "requests": len(reqs),
        "fit": fit.describe(),
        **cal,
        "ttft_median_rel_err": statistics.median(ttft_err),
        "tpot_median_rel_err": statistics.median(tpot_err),
        "ttft_p90_rel_err": sorted(ttft_err)[int(0.9 * (len(ttft_err) - 1))],
        "tpot_p90_rel_err": sorted(tpot_err)[int(0.9 * (len(tpot_err) - 1))],
        "measured_ttft_median_s": statistics.median(v[0] for v in live.values()),
        "predicted_ttft_median_s": statistics.median(v[0] for v in pred.values()),
        "measured_tpot_median_s": statistics.median(v[1] for v in live.values()),
        "predicted_tpot_median_s": statistics.median(v[1] for v in pred.values()),
    }
