"""Sim-to-real: replay a trace slice on the live CPU engine (``actors.replica_controller.ReplicaController``, the
tiny model) and in the simulator, and compare per-request TTFT and TPOT.

1. Calibrate on one slice of the trace: replay it live, record each iteration's batch
   ``(new tokens, cached context)`` (read from the engine's own scheduler step) and its wall
   time, and fit ``placement.fitted.SplitFittedCostModel`` (a constant, prefill tokens,
   prefill attention pairs, prefill requests, decode requests, decode context: prompt
   chunks and one-token decodes are priced separately).
2. Evaluate on a different slice (held out: no request of it was in the fit): replay it
   live; each ``Sequence`` records ``first_token_time`` and ``finish_time`` from
   ``time.monotonic()``.
3. Simulate the evaluation slice (same token ids, same scheduler settings, one colocated
   instance timed by the fitted model) and report median relative errors.

Both replays shrink lengths to the tiny model's 2k context (hash-id blocks become 32-token
blocks, so prefix sharing survives) and keep the trace's arrival gaps stretched by
``arrival_scale`` (1.5: a moderately loaded engine, so the comparison is not dominated by
queueing). Torch runs with one intra-op thread (``torch.set_num_threads(1)``): on this
2-core machine that makes step times stable, and the fit is of that configuration.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from placement.cost_model import CostModel
from placement.fitted import SplitFittedCostModel
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
    from actors.replica_controller import ReplicaController

    return ReplicaController(
        block_size=BLOCK, num_blocks=NUM_BLOCKS, token_budget=BUDGET, max_num_seqs=MAX_SEQS
    )


def _params(max_tokens: int) -> Any:
    from actors.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _pin_threads() -> None:
    import torch

    torch.set_num_threads(1)


def replay_live(
    reqs: list[TraceRequest],
) -> tuple[dict[str, tuple[float, float]], list[list[tuple[int, int]]], list[float]]:
    """Replay ``reqs`` in real time; per request (TTFT, TPOT), and every step's batch and
    wall time."""
    _pin_threads()
    engine = _engine()
    rec = _Recorder(engine)
    # Warm-up (one-off allocator and kernel costs), not timed.
    engine.add_request([1] * 64, _params(2), request_id="warmup")
    while engine.has_unfinished():
        engine.step()
    rec.seqs.clear()
    batches: list[list[tuple[int, int]]] = []
    secs: list[float] = []
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
            batch, dt = rec.timed_step()
            if batch:
                batches.append(batch)
                secs.append(dt)
        elif i < len(reqs):
            time.sleep(max(0.0, reqs[i].arrival - (time.monotonic() - t0)))
    out = {}
    for r in reqs:
        s = rec.seqs[r.request_id]
        ttft = s.first_token_time - s.arrival_time
        n = len(s.output_token_ids)
        tpot = (s.finish_time - s.first_token_time) / (n - 1) if n > 1 else 0.0
        out[r.request_id] = (ttft, tpot)
    return out, batches, secs


def replay_sim(reqs: list[TraceRequest], cost: CostModel) -> dict[str, tuple[float, float]]:
    spec = InstanceSpec(cost, NUM_BLOCKS, BLOCK, token_budget=BUDGET, max_num_seqs=MAX_SEQS)
    cluster = ColocatedCluster(1, spec, RoundRobin())
    cluster.token_fn = tiny_tokens
    stats = cluster.run(reqs)
    return {s.request_id: (s.ttft or 0.0, s.tpot or 0.0) for s in stats}


def _median_rel(pred: list[float], real: list[float]) -> float:
    return statistics.median(abs(p - r) / r for p, r in zip(pred, real, strict=True) if r > 0)


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))]


def run_sim_to_real(
    trace: str = "conversation",
    trace_dir: str | None = None,
    n: int = 40,
    seed: int = 0,
    calibration_offset: int = 100,
    calibration_requests: int = 60,
    arrival_scale: float = 1.5,
) -> dict[str, Any]:
    """Fit on trace requests ``[offset, offset + calibration_requests)``, evaluate on the
    first ``n``. ``seed`` is kept for the CLI; the replay itself is deterministic input."""
    del seed
    trace_reqs = load_trace(trace, trace_dir, limit=calibration_offset + calibration_requests)
    if calibration_offset < n:
        raise ValueError("the calibration slice must not overlap the evaluation slice")
    cal = trace_reqs[calibration_offset:]
    t_first = cal[0].arrival
    cal = [replace(r, arrival=r.arrival - t_first) for r in cal]
    _, cal_batches, cal_secs = replay_live(shrink(cal, arrival_scale))
    fit = SplitFittedCostModel.fit(cal_batches, cal_secs)
    reqs = shrink(trace_reqs[:n], arrival_scale)
    live, ev_batches, ev_secs = replay_live(reqs)
    pred = replay_sim(reqs, fit)
    keys = [k for k in live if live[k][1] > 0]
    ttft_err = [abs(pred[k][0] - live[k][0]) / live[k][0] for k in live if live[k][0] > 0]
    tpot_err = [abs(pred[k][1] - live[k][1]) / live[k][1] for k in keys]
    step_err = [abs(fit.batch_time(b) - t) / t for b, t in zip(ev_batches, ev_secs, strict=True)]
    return {
        "requests": len(reqs),
        "calibration_requests": len(cal),
        "calibration_slice": [calibration_offset, calibration_offset + calibration_requests],
        "arrival_scale": arrival_scale,
        "torch_threads": 1,
        "fit": fit.describe(),
        "calibration_steps": len(cal_batches),
        "heldout_steps": len(ev_batches),
        "step_median_rel_err_heldout": statistics.median(step_err),
        "ttft_median_rel_err": statistics.median(ttft_err),
        "tpot_median_rel_err": statistics.median(tpot_err),
        "ttft_p90_rel_err": _p90(ttft_err),
        "tpot_p90_rel_err": _p90(tpot_err),
        "measured_ttft_median_s": statistics.median(v[0] for v in live.values()),
        "predicted_ttft_median_s": statistics.median(v[0] for v in pred.values()),
        "measured_tpot_median_s": statistics.median(live[k][1] for k in keys),
        "predicted_tpot_median_s": statistics.median(pred[k][1] for k in keys),
        "ttft_median_err_of_medians": _median_rel(
            [statistics.median(v[0] for v in pred.values())],
            [statistics.median(v[0] for v in live.values())],
        ),
    }
