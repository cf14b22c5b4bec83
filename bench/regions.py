"""Three regions on the CPU engine: selective vs immediate pushing vs a fixed outstanding cap.

Regions us, eu, asia, one replica each (the bench model of ``bench/bench_model.py`` in a
``ColocatedEngine`` + ``EngineLoop``, ``--max-num-seqs`` requests per batch), each behind its
own ``actors.regions.BalancerRuntime`` running ``policies.region_balancer`` (prefix trie,
probes every ``--probe-interval`` s). Inter-region one-way delays are injected: us-eu 40 ms,
us-asia 80 ms, eu-asia 100 ms. All in one process on this machine.

Workload, tree-of-thought-like: each client solves one tree at a time (closed loop). A tree
is a random question (``--question`` tokens); a node's prompt is its parent's prompt, the
parent's output and a branch instruction (``--thought`` tokens); every node has
``--branch`` children down to ``--depth`` levels, children start when their parent
finishes, siblings run at once. Requests of one tree share their ancestors' prefixes.
Clients: ``--clients us,eu,asia`` (skewed: the us region is the busy one).

Modes, interleaved (``--repeats`` rounds of each, fresh engines per run, the same trees in
every run):
- selective: push only to a replica with no pending request, else forward to a peer with a
  free replica (SkyWalker);
- immediate: push at once to the local replica with the longest prefix (blind pushing;
  nothing is ever forwarded);
- cap: push while a replica has fewer than ``--cap`` outstanding requests, else forward.

Per run: requests completed per second, client-side P50/P90 TTFT, prefix-cache hit ratio
(cached / prompt tokens), requests forwarded. Greedy outputs of a request must be the same in
every run (checked). Medians over the repeats; the last line is
``p90-ttft immediate/selective: <ratio>`` (medians, two decimals).

``--model M --dataset sharegpt``: a real model (a ``.gguf``, a folder or a packaged name
such as SmolLM2-135M-Instruct) and real text: a tree's question is a ShareGPT first turn in
the model's chat template, a branch instruction a later ShareGPT user turn (under 400
characters) appended as the next user turn after the parent's answer; ``--question`` and
``--thought`` are then unused. ``--kv-mib`` sizes each replica's KV cache (a real model's
KV is larger per token).

    python bench/regions.py [--duration 20] [--repeats 2]
    python bench/regions.py --model SmolLM2-135M-Instruct --dataset sharegpt --kv-mib 512
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from actors.engine.worker_hooks import WorkerHooks
from actors.regions.runtime import BalancerRuntime, LocalReplica
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import interleaved
from bench.real_prompts import add_model_options, chosen_model
from policies.region_balancer import BalancerConfig, RegionBalancer
from policies.request import SamplingParams
from sim.metrics import percentile

REGIONS = ("us", "eu", "asia")
DELAY = {("us", "eu"): 0.04, ("us", "asia"): 0.08, ("eu", "asia"): 0.1}
MODES = ("selective", "immediate", "cap")


def delay(a: str, b: str) -> float:
    return 0.0 if a == b else DELAY.get((a, b), DELAY.get((b, a), 0.0))


def build_replica(
    model_dir: Path, a: argparse.Namespace, worker_hooks: WorkerHooks | None = None
) -> tuple[ColocatedEngine, EngineLoop]:
    """One replica: ``a.token_budget``, ``a.max_num_seqs``, ``a.kv_mib`` MiB of KV."""
    engine = ColocatedEngine.build(
        model_dir,
        worker_hooks=worker_hooks,
        block_size=16,
        token_budget=a.token_budget,
        max_num_seqs=a.max_num_seqs,
        kv_cache_memory=a.kv_mib << 20,
    )
    return engine, EngineLoop(engine)


def connect_all(lbs: list[BalancerRuntime]) -> None:
    """Every balancer a peer of every other one."""
    for x in lbs:
        for y in lbs:
            if x is not y:
                x.connect(y)


@dataclass
class Run:
    mode: str
    completed: int = 0
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    forwarded: int = 0
    elapsed: float = 0.0
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.completed / self.elapsed if self.elapsed else 0.0

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Path) -> None:
        self.args = args
        self.model_dir = model_dir
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)
        # real text (--dataset sharegpt): questions and branch turns to draw from, as ids
        self.questions: list[list[int]] = []
        self.thoughts: list[list[int]] = []
        if args.dataset != "random":
            from bench.real_prompts import dialogues, short_prompts, tokenizer, turn_ids

            tok = tokenizer(args.model)
            self.questions = short_prompts(tok, 64, seed=0)
            self.thoughts = [turn_ids(tok, d[1]) for d in dialogues(2, 64, seed=1, max_chars=400)]

    def engines(self) -> dict[str, tuple[ColocatedEngine, EngineLoop]]:
        return {region: build_replica(self.model_dir, self.args) for region in REGIONS}

    def config(self, mode: str) -> BalancerConfig:
        if mode == "selective":
            return BalancerConfig(push="selective")
        if mode == "cap":
            return BalancerConfig(push="cap", outstanding_cap=self.args.cap)
        return BalancerConfig(push="immediate")

    async def tree(
        self, lb: BalancerRuntime, builder, run: Run, client: str, k: int, deadline: float
    ) -> None:
        a = self.args
        rng = random.Random(f"{client}/{k}")
        vocab = MODEL["vocab_size"]
        question = (
            list(rng.choice(self.questions))
            if self.questions
            else [rng.randrange(3, vocab) for _ in range(a.question)]
        )

        async def node(prompt: list[int], path: str, level: int) -> None:
            if time.monotonic() >= deadline:
                return
            rid = f"{client}/{k}/{path}"
            req = builder.build(prompt, self.params, request_id=rid)
            t0 = time.monotonic()
            res = await lb.handle(req, session_id=f"{client}/{k}")
            run.ttft.append(res.first_token_at - t0)
            out = res.output
            run.completed += 1
            run.prompt_tokens += len(prompt)
            run.cached_tokens += out.num_cached_tokens
            run.forwarded += res.forwarded
            run.outputs[rid] = list(out.token_ids)
            if level + 1 >= a.depth:
                return
            children = []
            for b in range(a.branch):
                crng = random.Random(f"{rid}/{b}")
                thought = (
                    list(crng.choice(self.thoughts))
                    if self.thoughts
                    else [crng.randrange(3, vocab) for _ in range(a.thought)]
                )
                children.append(node(prompt + out.token_ids + thought, f"{path}{b}", level + 1))
            await asyncio.gather(*children)

        await node(question, "r", 0)

    async def client(
        self, lb: BalancerRuntime, builder, run: Run, client: str, deadline: float
    ) -> None:
        k = 0
        while time.monotonic() < deadline:
            await self.tree(lb, builder, run, client, k, deadline)
            k += 1

    async def run_mode(self, mode: str) -> Run:
        a = self.args
        engines = self.engines()
        builder = engines["us"][0].request_builder()
        run = Run(mode)
        lbs = {}
        for region in REGIONS:
            policy = RegionBalancer(f"lb-{region}", region, self.config(mode))
            replica = LocalReplica(f"{region}0", engines[region][1])
            lbs[region] = BalancerRuntime(policy, [replica], delay, a.probe_interval)
        connect_all(list(lbs.values()))
        for lb in lbs.values():
            lb.start()
        counts = dict(zip(REGIONS, (int(c) for c in a.clients.split(",")), strict=True))
        t0 = time.monotonic()
        deadline = t0 + a.duration
        try:
            await asyncio.gather(
                *(
                    self.client(lbs[r], builder, run, f"{r}{i}", deadline)
                    for r in REGIONS
                    for i in range(counts[r])
                )
            )
        finally:
            run.elapsed = time.monotonic() - t0
            for lb in lbs.values():
                await lb.close()
            for _, loop in engines.values():
                loop.shutdown()
        return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--clients", default="6,1,1", help="closed-loop clients in us,eu,asia")
    p.add_argument("--question", type=int, default=192, help="tokens of a tree's question")
    p.add_argument("--thought", type=int, default=32, help="tokens added per tree level")
    p.add_argument("--branch", type=int, default=2)
    p.add_argument("--depth", type=int, default=3, help="levels of a tree (root = 1)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=4, help="batch size of a replica")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--cap", type=int, default=4, help="outstanding cap of the cap mode")
    p.add_argument("--probe-interval", type=float, default=0.1)
    p.add_argument("--kv-mib", type=int, default=64, help="KV cache per replica, MiB")
    add_model_options(p, "sharegpt: ShareGPT turns as questions and branches; needs --model")
    a = p.parse_args()
    real = chosen_model(p, a)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(a, real or write_bench_model(Path(tmp) / "bench"))

        def one(mode: str, rep: int) -> Run:
            r = asyncio.run(bench.run_mode(mode))
            print(
                f"round {rep} {mode:9s}: {r.completed} requests, {r.throughput:.2f} req/s, "
                f"TTFT p50 {percentile(r.ttft, 50):.3f} s "
                f"p90 {percentile(r.ttft, 90):.3f} s, "
                f"hit {100 * r.hit:.1f}%, forwarded {r.forwarded}",
                flush=True,
            )
            return r

        runs = interleaved(MODES, a.repeats, one, rotate=False)
    reference: dict[str, list[int]] = {}
    mismatched = 0
    for rs in runs.values():
        for r in rs:
            for rid, toks in r.outputs.items():
                if rid in reference and reference[rid] != toks:
                    mismatched += 1
                reference.setdefault(rid, toks)
    print(f"greedy outputs compared across runs: {len(reference)} requests, {mismatched} differ")
    med = {
        m: {
            "tput": statistics.median(r.throughput for r in rs),
            "p50": statistics.median(percentile(r.ttft, 50) for r in rs),
            "p90": statistics.median(percentile(r.ttft, 90) for r in rs),
            "hit": statistics.median(r.hit for r in rs),
            "fwd": statistics.median(r.forwarded for r in rs),
        }
        for m, rs in runs.items()
    }
    print("mode       req/s   TTFT p50  TTFT p90  hit    forwarded (medians)")
    for m, x in med.items():
        print(
            f"{m:9s}  {x['tput']:5.2f}   {x['p50']:7.3f}   {x['p90']:7.3f}   "
            f"{100 * x['hit']:4.1f}%  {x['fwd']:g}"
        )
    if mismatched:
        print("ERROR: greedy outputs differ between runs")
        sys.exit(1)
    print(f"p90-ttft immediate/selective: {med['immediate']['p90'] / med['selective']['p90']:.2f}")


if __name__ == "__main__":
    main()
