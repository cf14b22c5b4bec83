"""Measured: decode step time of a disaggregated MoE replica on Ray with m = 1 against m = 3
micro-batches (the ping-pong pipeline), on a random MoE model (4 layers, hidden 512, 8
experts of intermediate 1024, top 2), one attention and two expert worker actors.

Runs alternate (m=1, m=3, m=1, m=3, ...; each starts its own actors and tears them down) so
machine noise hits both alike. Each run decodes ``--requests`` requests for ``--tokens``
steps after their prompts; it reports the median decode step time and the overlap: the share
of the expert workers' busy time during which an attention worker was busy on another
micro-batch (0 for m = 1 by construction). Last line: the medians over runs and the ratio.

  python bench/moe_pingpong.py --runs 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from actors.engine.replica_controller import ReplicaController  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from actors.moe.messages import StageTime  # noqa: E402
from models import write_tiny_model  # noqa: E402

MODEL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
)
CHANNEL_ENV = {"RAY_CGRAPH_buffer_size_bytes": str(1 << 24)}


def overlap_share(times: list[StageTime]) -> float:
    """Share of expert busy seconds overlapped by attention work on another micro-batch."""
    attention = [t for t in times if t[0] == "attention"]
    busy = covered = 0.0
    for e in (t for t in times if t[0] == "expert"):
        busy += e[5] - e[4]
        spans = sorted(
            (max(a[4], e[4]), min(a[5], e[5]))
            for a in attention
            if a[3] != e[3] and a[4] < e[5] and e[4] < a[5]
        )
        end = e[4]
        for lo, hi in spans:  # union of the overlapping spans
            lo = max(lo, end)
            if hi > lo:
                covered += hi - lo
                end = hi
    return covered / busy if busy else 0.0


def run(model_dir: Path, m: int, requests: int, tokens: int) -> tuple[float, float]:
    controller = ReplicaController.build(
        model_dir, attention_workers=1, expert_workers=2, micro_batches=m, block_size=16
    )
    try:
        builder = controller.request_builder()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(requests):
            prompt = [(i * 7919 + j * 104729) % 500 + 3 for j in range(16)]
            controller.add_request(builder.build(prompt, params))
        controller.step()  # every prompt in one step (16 x requests <= the token budget)
        steps = []
        while controller.has_unfinished():
            began = time.perf_counter()
            controller.step()
            steps.append(time.perf_counter() - began)
        executor = controller.executor
        timeline = list(getattr(executor, "timeline", []))[-len(steps) :]
        share = statistics.median(overlap_share(times) for _, times in timeline)
        return statistics.median(steps[1:]), share
    finally:
        controller.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2, help="runs of each m, alternating")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    os.environ.update(CHANNEL_ENV)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": CHANNEL_ENV})
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "moe", kind="moe", **MODEL)
    results: dict[int, list[tuple[float, float]]] = {1: [], 3: []}
    for r in range(args.runs):
        for m in (1, 3):
            step, share = run(model_dir, m, args.requests, args.tokens)
            results[m].append((step, share))
            print(f"run {r} m={m}: decode step {step * 1e3:.1f} ms, overlap {share:.2f}")
    ray.shutdown()
    med = {m: statistics.median(s for s, _ in v) for m, v in results.items()}
    share = {m: statistics.median(o for _, o in v) for m, v in results.items()}
    print(
        f"decode step median: m=1 {med[1] * 1e3:.1f} ms, m=3 {med[3] * 1e3:.1f} ms, "
        f"m=1/m=3 {med[1] / med[3]:.2f}x; expert time overlapped by attention: "
        f"m=1 {share[1]:.2f}, m=3 {share[3]:.2f}"
    )


if __name__ == "__main__":
    main()
