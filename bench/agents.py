"""Agent trajectories through the OpenAI endpoint: does a multi-turn agent see a shorter
time to first token per turn on P/D with the KV store and DualPath than on the colocated
app with its prefix cache only?

Trajectories (``sim.agent_trajectories``): conversations recovered from the repository's
Mooncake conversation trace (first prompt, user appends and pauses), with DualPath's tool
steps between the user turns (tool outputs of 430-610 tokens, answers of 150-180, tool
pauses log-normal around 2 s), then scaled for a CPU: lengths times ``--length-scale``,
pauses times ``--pause-scale`` (at most ``--max-pause`` s), the first ``--turns`` turns.
Every turn's prompt is the previous prompt, the model's answer (its token ids, streamed
back with ``return_token_ids``) and the turn's append (random token ids, fixed by the
seed), so each turn's context grows and its whole past is a prefix of it.

Client: ``--concurrency`` agents in a closed loop over ``--trajectories`` trajectories;
each agent runs one trajectory turn by turn (pause, then one streamed ``POST
/v1/completions`` with the trajectory's ``session_id``, greedy, ``ignore_eos``), then
takes the next. Requests are plain turns: the bench model has random weights and no chat
template, so it sends no ``tools``.

Setups, each a Serve app (``serve_app.build_app``) on the bench model (8 layers, hidden
512, random weights, fp32; ``bench/bench_model.py``), every engine with the same config
(``--kv-cache-mib`` of KV each: less than the agents' live contexts, as a GPU's HBM holds
fewer sessions than the store's DRAM):

- colocated: two colocated replicas, prefix-aware routing, the prefix cache only;
- pd-prefill: one prefill and one decode replica, a KV store of ``--store-mib`` with
  decode write-back, every stored prefix read on the prefill side (Mooncake's Conductor);
- dualpath: the same, stored prefixes read on the side with the shorter read queue and
  DualPath's scheduler placing requests.

One run = one app started, the warm-up, every trajectory, the app deleted. Runs are
interleaved (colocated, pd-prefill, dualpath, then rotated), ``--repeats`` of each;
figures are medians over runs. Reported per setup: each turn's TTFT p50/p99 (all turns
and turns after the first), the trajectory completion time (first send to last token,
pauses included), goodput (turns per second whose TTFT met ``--ttft-slo``), the share
of prompt tokens the server reported as cached (``usage.prompt_tokens_details``), and the
mean TTFT as the client saw it beside the replicas' own (their ``time_to_first_token``
metric, from ``/metrics``): the gap is the HTTP and relay path.

Last line: ``agent turn-ttft-p50 colocated/dualpath: <ratio>`` (the median of the
per-repeat ratios of all turns' TTFT p50).

    flock /tmp/bench.lock python bench/agents.py [--repeats 3] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_model import MODEL, write_bench_model  # noqa: E402
from serve_records import TokenClock, percentile, sse_chunks  # noqa: E402

from sim.agent_trajectories import (  # noqa: E402
    AgentTrajectory,
    build_trajectories,
    scaled,
    summary,
)
from sim.traces import load_trace  # noqa: E402

APP = "bench-agents"
MODEL_NAME = "bench"
SETUPS = ("colocated", "pd-prefill", "dualpath")


@dataclass
class TurnSample:
    traj: int
    turn: int
    ttft: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class AgentRun:
    setup: str
    duration: float = 0.0
    turns: list[TurnSample] = field(default_factory=list)
    completions: list[float] = field(default_factory=list)  # per trajectory, seconds
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    refused: int = 0  # 429s the agents retried
    server_ttft: float = float("nan")  # the replicas' own mean TTFT (their metric), seconds

    def metrics(self, slo: float) -> dict[str, float]:
        ttft = [s.ttft * 1e3 for s in self.turns]
        later = [s.ttft * 1e3 for s in self.turns if s.turn > 0]
        prompt = sum(s.prompt_tokens for s in self.turns)
        return {
            "turns": len(self.turns),
            "duration_s": self.duration,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": percentile(ttft, 0.99),
            "later_ttft_p50_ms": statistics.median(later) if later else float("nan"),
            "later_ttft_p99_ms": percentile(later, 0.99),
            "completion_p50_s": statistics.median(self.completions),
            "completion_max_s": max(self.completions),
            "goodput_turns_s": sum(s.ttft <= slo for s in self.turns) / self.duration,
            "cached_share": sum(s.cached_tokens for s in self.turns) / prompt if prompt else 0.0,
            "refused": self.refused,
            "mean_ttft_ms": statistics.fmean(ttft),
            "server_mean_ttft_ms": self.server_ttft * 1e3,
        }


# -- the workload ---------------------------------------------------------------------------
def trajectories(args: argparse.Namespace) -> list[AgentTrajectory]:
    trace = load_trace("conversation", args.trace_dir)
    built = build_trajectories(trace, args.trajectories, seed=args.seed)
    return scaled(
        built,
        length=args.length_scale,
        pause=args.pause_scale,
        max_turns=args.turns,
        max_output=args.max_output,
        max_pause_s=args.max_pause,
        max_first=args.max_first,
    )


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(n)]


class Refused(Exception):
    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after


class Agent:
    """The agents' client of the endpoint: streamed completions, TTFT per turn (from the
    first send, retries after a 429 included)."""

    def __init__(self, base_url: str) -> None:
        self.refused = 0
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )

    async def turn(self, prompt: list[int], max_tokens: int, session: str) -> tuple[Any, ...]:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "session_id": session,
        }
        clock = TokenClock()  # from the first send: a refused turn's wait counts
        while True:
            try:
                return await self._stream(body, clock)
            except Refused as e:  # 429: an agent retries after Retry-After
                self.refused += 1
                await asyncio.sleep(e.retry_after)

    async def _stream(self, body: dict[str, Any], clock: TokenClock) -> tuple[Any, ...]:
        out: list[int] = []
        usage: dict[str, Any] = {}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 429:
                raise Refused(min(1.0, float(r.headers.get("retry-after", "0.1"))))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for chunk in sse_chunks(r.aiter_lines()):
                usage = chunk.get("usage") or usage
                ids = [i for c in chunk.get("choices") or () for i in c.get("token_ids") or ()]
                if ids:
                    out += ids
                    clock.tick()
        end = time.perf_counter()
        if clock.first is None:
            raise RuntimeError("the stream carried no tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return clock.first - clock.start, end - clock.start, out, cached

    async def close(self) -> None:
        await self.client.aclose()


async def run_agents(
    url: str, setup: str, trajs: list[AgentTrajectory], concurrency: int, seed: int
) -> AgentRun:
    run = AgentRun(setup)
    agent = Agent(url)
    todo = iter(range(len(trajs)))

    async def one_trajectory(i: int) -> None:
        t = trajs[i]
        prompt = token_ids(seed * 1_000_003 + i, t.first)
        start = time.perf_counter()
        for k, step in enumerate(t.turns):
            if k:
                await asyncio.sleep(step.pause_s)
                prompt = prompt + run.outputs[(i, k - 1)]
                prompt += token_ids(seed * 1_000_003 + i * 1000 + k, step.append)
            ttft, e2e, out, cached = await agent.turn(prompt, step.output, f"agent-{seed}-{i}")
            run.outputs[(i, k)] = out
            run.turns.append(TurnSample(i, k, ttft, e2e, len(prompt), cached))
        run.completions.append(time.perf_counter() - start)

    async def worker() -> None:
        for i in todo:  # one shared iterator: each trajectory goes to one agent
            await one_trajectory(i)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await agent.close()
    run.duration = time.perf_counter() - t0
    run.refused = agent.refused
    return run


# -- the setups -----------------------------------------------------------------------------
def app_config(setup: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = {
        "block_size": 16,
        "kv_cache_memory": args.kv_cache_mib << 20,
        "token_budget": 512,
        "max_num_seqs": 64,
    }
    cfg: dict[str, Any] = {"model": model_dir, "model_name": MODEL_NAME, "report_interval_s": 0.1}
    if setup == "colocated":
        cfg["routing"] = "prefix_aware"
        cfg["groups"] = [{"name": "main", "num_replicas": 2, "engine": engine}]
        return cfg
    dual = setup == "dualpath"
    cfg["groups"] = [
        {
            "name": "pd",
            "num_replicas": 1,
            "num_prefill": 1,
            "num_decode": 1,
            "engine": engine,
            "store": {
                "dram_bytes": args.store_mib << 20,
                "read_path": "dual" if dual else "prefill",
                "write_back": True,
            },
            "conductor": {"scheduler": "dualpath" if dual else "mooncake"},
        }
    ]
    return cfg


def expected_replicas(setup: str) -> int:
    return 2 if setup == "colocated" else 1


def wait_healthy(url: str, replicas: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200 and r.json().get("replicas", 0) >= replicas:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the app did not become healthy")


TTFT_METRIC = "meridian:time_to_first_token_seconds"


def ttft_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the replicas' TTFT histogram (arrival to first token), all replicas."""
    total, count = 0.0, 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        if name == TTFT_METRIC + "_sum":
            total += float(value)
        elif name == TTFT_METRIC + "_count":
            count += float(value)
    return total, count


def one_run(
    setup: str, url: str, model_dir: str, trajs: list[AgentTrajectory], args: argparse.Namespace
) -> AgentRun:
    from ray import serve

    from serve_app import build_app

    serve.run(build_app(app_config(setup, model_dir, args)), name=APP, route_prefix="/")
    try:
        wait_healthy(url, expected_replicas(setup))
        warm = [AgentTrajectory(64, trajs[0].turns[:2], "warm-up")]  # compiles each path once
        asyncio.run(run_agents(url, setup, warm, 1, seed=-1))
        before = ttft_totals(url)
        run = asyncio.run(run_agents(url, setup, trajs, args.concurrency, args.seed))
        time.sleep(2.2)  # an idle replica pushes its last metrics within its heartbeat
        after = ttft_totals(url)
        if after[1] > before[1]:
            run.server_ttft = (after[0] - before[0]) / (after[1] - before[1])
        return run
    finally:
        serve.delete(APP)


# -- main -----------------------------------------------------------------------------------
ROWS = (
    ("turn TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("turn TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("later-turn TTFT p50 (ms)", "later_ttft_p50_ms", "{:.0f}"),
    ("later-turn TTFT p99 (ms)", "later_ttft_p99_ms", "{:.0f}"),
    ("trajectory completion p50 (s)", "completion_p50_s", "{:.1f}"),
    ("trajectory completion max (s)", "completion_max_s", "{:.1f}"),
    ("goodput, TTFT <= SLO (turns/s)", "goodput_turns_s", "{:.2f}"),
    ("prompt tokens cached (server)", "cached_share", "{:.0%}"),
    ("mean turn TTFT, client (ms)", "mean_ttft_ms", "{:.0f}"),
    ("mean turn TTFT, replicas (ms)", "server_mean_ttft_ms", "{:.0f}"),
    ("429s retried", "refused", "{:.0f}"),
    ("run time (s)", "duration_s", "{:.1f}"),
)


def print_table(results: dict[str, list[AgentRun]], slo: float) -> dict[str, dict[str, float]]:
    meds = {}
    for setup, runs in results.items():
        per = [r.metrics(slo) for r in runs]
        meds[setup] = {k: statistics.median(m[k] for m in per) for k in per[0]}
    print(f"{'median of runs':32s}" + "".join(f"{s:>13s}" for s in results))
    for label, key, fmt in ROWS:
        print(f"{label:32s}" + "".join(f"{fmt.format(meds[s][key]):>13s}" for s in results))
    return meds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="agents at once")
    ap.add_argument("--turns", type=int, default=8, help="the first N turns of each")
    ap.add_argument("--length-scale", type=float, default=1 / 16)
    ap.add_argument("--max-first", type=int, default=768, help="first prompt, at most")
    ap.add_argument("--max-output", type=int, default=16, help="tokens per answer, at most")
    ap.add_argument("--pause-scale", type=float, default=0.25)
    ap.add_argument("--max-pause", type=float, default=3.0, help="seconds, per pause")
    ap.add_argument("--kv-cache-mib", type=int, default=48, help="KV per engine")
    ap.add_argument("--store-mib", type=int, default=512, help="the KV store's DRAM")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="seconds, for goodput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", help="write the medians here (for python -m sim agents --live)")
    args = ap.parse_args()

    trajs = trajectories(args)
    s = summary(trajs)
    print(
        f"{len(trajs)} trajectories, {s['turns']} turns (first prompt {s['mean_first']:.0f} "
        f"tokens on average, appends {s['mean_append']:.0f}, answers {s['mean_output']:.0f}, "
        f"final context {s['mean_final_context']:.0f}, median tool pause "
        f"{s['median_tool_pause_s']:.2f} s); {args.concurrency} agents at once; KV per engine "
        f"{args.kv_cache_mib} MiB, store {args.store_mib} MiB; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    import ray
    from ray import serve

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["RAY_CGRAPH_buffer_size_bytes"] = str(1 << 24)
    os.environ.update(env)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
        _system_config={"worker_niceness": 0},
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[AgentRun]] = {s: [] for s in args.setups}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(write_bench_model(Path(tmp) / "bench"))
            for rep in range(args.repeats):
                k = rep % len(args.setups)  # the setup that goes first rotates
                for setup in args.setups[k:] + args.setups[:k]:
                    run = one_run(setup, url, model_dir, trajs, args)
                    results[setup].append(run)
                    m = run.metrics(args.ttft_slo)
                    print(
                        f"[rep {rep}] {setup:>10s}: TTFT p50 {m['ttft_p50_ms']:.0f} ms p99 "
                        f"{m['ttft_p99_ms']:.0f} ms, completion p50 "
                        f"{m['completion_p50_s']:.1f} s, goodput {m['goodput_turns_s']:.2f} "
                        f"turns/s, cached {m['cached_share']:.0%}, run {run.duration:.1f} s "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print(f"{len(trajs)} trajectories x {args.turns} turns, {args.repeats} runs per setup")
    meds = print_table(results, args.ttft_slo)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "medians": meds}, indent=1))
    first = results[args.setups[0]]
    same = all(r.outputs == first[0].outputs for runs in results.values() for r in runs)
    print(f"answers identical in every run: {same}")
    if "colocated" in results and "dualpath" in results:
        ratios = [
            a.metrics(args.ttft_slo)["ttft_p50_ms"] / b.metrics(args.ttft_slo)["ttft_p50_ms"]
            for a, b in zip(results["colocated"], results["dualpath"], strict=True)
        ]
        print(f"per-run ratios: {', '.join(f'{r:.2f}' for r in ratios)}")
        print(f"agent turn-ttft-p50 colocated/dualpath: {statistics.median(ratios):.2f}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
