"""Medha's adaptive chunks under sequence-pipeline parallelism: the time between tokens of
co-batched decodes while a long prompt prefills on a two-stage replica, against the TBT SLO.

The 8-layer, hidden-512 bench model (``bench/bench_model.py``, positions raised to fit the
long prompt), fp32, greedy, ``spp=2`` on a local Ray cluster (two stage actors driven
through a compiled graph, two steps in flight). The workload: ``--decodes`` short requests
(``--short`` prompt tokens, ``--decode-new`` new tokens) start and reach decode; then one
``--long``-token prompt arrives. Measured: every gap between consecutive tokens of a decode
that ends while the long prompt prefills (from its arrival to its first token); reported as
p99 over ``--slo`` (the TBT SLO, seconds). Two configurations of the same replica:

  adaptive  Medha's batch packer: each step's prefill chunk is the largest the runtime
            predictor (refitted from the pipelined steps' stage times) keeps under a target
            step time of ``--margin`` x the SLO, the fit scaled by the 0.9 quantile of
            recent steps' measured / predicted time (``TailStepTime``: the SLO bounds a
            tail, the fit is a mean), so chunks shrink as the prompt's KV grows. The
            default margin is 1 / spp: a decode rides in every other step (its next step
            waits for its token) and on this 2-core machine the steps between its tokens
            overlap little (the two stages and the driver share the cores)
  fixed     FCFS with a fixed chunk of the size the adaptive packer starts the long prompt
            with (its first chunk in its last warm-up run)

Run interleaved (adaptive, fixed, adaptive, ...) after one warm-up run each (the warm-up
fits the adaptive replica's predictor; not counted). Every long prompt's tokens equal the
single-process engine's, and every decode's tokens are a prefix of its single-process
tokens (greedy: the schedule may change, the tokens may not). Medians over ``--repeats``.

    python bench/spp_adaptive.py [--repeats 3] [--long 4096] [--slo 0.4] [--margin 0.5]

Last line: ``spp-adaptive tbt-p99/slo adaptive fixed: <a> <f>``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.engine.collectives import Layout
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.engine.step_plan import StepPlan
from actors.engine.worker_hooks import WorkerHooks
from bench.bench_model import MODEL
from bench.interleave import interleaved, medians
from bench.local_serve import local_ray
from models import write_tiny_model
from sim.metrics import percentile

CHANNEL_ENV = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}


class ChunkReport:
    """Stage 0 reports each step's prefill chunks, ``(new tokens, start)``."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def begin_step(self, plan: StepPlan, kv_caches: Any) -> None:
        pass

    def after_layer(self, layer: int, kv_cache: Any) -> None:
        pass

    def end_step(self, plan: StepPlan, kv_caches: Any) -> Any:
        if self.stage != 0:
            return None
        return [(e.num_tokens, e.start) for e in plan.entries if e.num_tokens > 1]


def chunk_hooks(coords: tuple[int, int, int], layout: Layout) -> WorkerHooks:
    return WorkerHooks(step=ChunkReport(coords[1]))


def run_once(engine: ReplicaController, args, shorts: list[list[int]], long: list[int]) -> dict:
    """Decodes first; the long prompt once every decode has its first token; step until
    all end. Returns the TBT gaps that ended during the long prefill, the long prompt's
    chunks, and every request's tokens."""
    builder = engine.request_builder()
    decode_params = SamplingParams(max_tokens=args.decode_new, temperature=0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=args.long_new, temperature=0, ignore_eos=True)
    ids = [engine.add_request(builder.build(p, decode_params)) for p in shorts]
    last: dict[str, float] = {}
    while len(last) < len(ids):
        for d in engine.step():
            last[d.request_id] = time.monotonic()
    engine.take_hook_reports()
    long_id = engine.add_request(builder.build(long, long_params))
    arrived = time.monotonic()
    prefilled: float | None = None
    gaps: list[float] = []
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.monotonic()
        for d in deltas:
            if d.request_id == long_id:
                prefilled = prefilled or now
            elif prefilled is None:
                gaps.append(now - last[d.request_id])
            last[d.request_id] = now
            if d.finished and d.request_id != long_id and prefilled is None:
                raise SystemExit(
                    "a decode ended before the long prompt's first token: raise --decode-new"
                )
    engine.on_idle()
    assert prefilled is not None
    chunks = [c for report in engine.take_hook_reports() if report for c in report]
    return {
        "tokens": [engine.release(rid).token_ids for rid in [*ids, long_id]],
        "p99": percentile(gaps, 99),
        "p50": percentile(gaps, 50),
        "gaps": len(gaps),
        "ttft": prefilled - arrived,
        "chunks": [n for n, _ in chunks],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--long-new", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--decode-new", type=int, default=48)
    ap.add_argument("--slo", type=float, default=0.4, help="TBT SLO (seconds)")
    ap.add_argument("--margin", type=float, default=0.5, help="packer target / SLO")
    args = ap.parse_args()

    rng = random.Random(0)
    vocab = MODEL["vocab_size"]
    shorts = [[rng.randrange(3, vocab) for _ in range(args.short)] for _ in range(args.decodes)]
    long = [rng.randrange(3, vocab) for _ in range(args.long)]
    common = dict(block_size=16, enable_prefix_caching=False, num_blocks=1024)
    with local_ray(CHANNEL_ENV, num_cpus=2):
        with tempfile.TemporaryDirectory() as tmp:
            model = dict(MODEL, max_position_embeddings=max(8192, 2 * args.long))
            folder = write_tiny_model(Path(tmp) / "m", kind="dense", seed=0, **model)
            t0 = time.monotonic()
            single = ReplicaController.build(folder, chunk_size=256, token_budget=512, **common)
            ref = run_once(single, args, shorts, long)["tokens"]
            single.shutdown()
            print(f"single-process reference: {time.monotonic() - t0:.0f}s", flush=True)

            target = args.margin * args.slo
            engines = {
                "adaptive": ReplicaController.build(
                    folder,
                    spp=2,
                    token_budget=4096,
                    target_batch_time=target,
                    worker_hooks=chunk_hooks,
                    **common,
                )
            }
            warm = run_once(engines["adaptive"], args, shorts, long)
            warm = run_once(engines["adaptive"], args, shorts, long)  # on the refitted predictor
            start = warm["chunks"][0]
            print(f"adaptive warm-up chunks: {warm['chunks']}", flush=True)
            engines["fixed"] = ReplicaController.build(
                folder,
                spp=2,
                chunk_size=start,
                token_budget=start + args.decodes,
                worker_hooks=chunk_hooks,
                **common,
            )
            run_once(engines["fixed"], args, shorts, long)  # warm-up

            def one(name: str, rep: int) -> dict:
                r = run_once(engines[name], args, shorts, long)
                print(
                    f"repeat {rep + 1} {name}: TBT p50 {r['p50'] * 1e3:.0f}ms "
                    f"p99 {r['p99'] * 1e3:.0f}ms over {r['gaps']} gaps, long TTFT "
                    f"{r['ttft']:.2f}s, chunks {r['chunks']}",
                    flush=True,
                )
                tokens = r["tokens"]
                if tokens[-1] != ref[-1]:
                    raise SystemExit(
                        f"{name}: the long prompt's tokens differ from the single process"
                    )
                for got, want in zip(tokens[:-1], ref[:-1], strict=True):
                    if got != want[: len(got)]:
                        raise SystemExit(
                            f"{name}: a decode's tokens differ from the single process"
                        )
                return r

            results = interleaved(list(engines), args.repeats, one, rotate=False)
            pred = engines["adaptive"].predictor
            assert pred is not None
            print(
                f"adaptive predictor: {pred.describe()} ({pred.fitter.num_fits['prefill']} fits), "
                f"measured / predicted p90 {pred.overrun(0.9):.2f}"
            )
            for engine in engines.values():
                engine.shutdown()
            print(f"greedy tokens equal the single process; {time.monotonic() - t0:.0f}s")
            med = {name: medians(rs, ("p99", "p50", "ttft")) for name, rs in results.items()}
            for name, m in med.items():
                print(
                    f"{name}: decode TBT p50 {m['p50'] * 1e3:.0f}ms p99 {m['p99'] * 1e3:.0f}ms "
                    f"(SLO {args.slo * 1e3:.0f}ms), long TTFT {m['ttft']:.2f}s (medians)"
                )
            a, f = med["adaptive"]["p99"] / args.slo, med["fixed"]["p99"] / args.slo
            print(f"spp-adaptive tbt-p99/slo adaptive fixed: {a:.2f} {f:.2f}")


if __name__ == "__main__":
    main()
