"""Agent trajectories through the OpenAI endpoint: does a multi-turn agent see a shorter TTFT
per turn on P/D with the KV store and DualPath than on the colocated app's prefix cache?

Trajectories (``sim.agent_trajectories``): conversations recovered from the repository's
Mooncake conversation trace (first prompt, user appends and pauses), with DualPath's tool
steps between the user turns (tool outputs of 430-610 tokens, answers of 150-180, tool
pauses log-normal around 2 s), then scaled for a CPU: lengths times ``--length-scale``,
pauses times ``--pause-scale`` (at most ``--max-pause`` s), the first ``--turns`` turns.
Every turn's messages are the previous turn's, the model's answer and the turn's append
(words, fixed by the seed); the chat template renders each message on its own, so each
turn's prompt grows and the previous prompt is a prefix of it.

Client: ``--concurrency`` agents (started evenly over ``--ramp`` s) in a closed loop over
``--trajectories`` trajectories; each agent runs one trajectory turn by turn (pause, then
one streamed ``POST /v1/chat/completions`` with the trajectory's ``session_id``, greedy,
``return_token_ids``), then takes the next. Every turn offers one tool (``bash``, its
``cmd`` an enum); a turn followed by a tool step names it in ``tool_choice`` (with
``parallel_tool_calls: false``), so its answer is a tool call constrained to the schema,
streamed as OpenAI's ``delta.tool_calls``; the next turn sends that call back as the
assistant's ``tool_calls`` and the tool's output (the step's append, as text) as a
``tool`` message. Other turns are ``tool_choice: auto`` and answer ``--max-output`` tokens
of text (``ignore_eos``), sent back as the assistant's content, the user's append after
it. The bench model (8 layers, hidden 512, random weights, fp32; ``bench/bench_model.py``)
has a plain chat template (role, content; tools and calls are not rendered) and a
byte-level tokenizer (one token per character), so the app sets ``tool_parser: hermes``
and appends are words of that many characters.

The regime is DualPath's: the agents' sessions hold several engines' worth of KV and tool
pauses let other agents' turns evict a paused agent's prefix from a colocated engine, while
P/D keeps it in the store (``--store-mib``, decode write-back) (printed as "regime:").

Setups, each a Serve app (``serve_app.build_app``) on the bench model: colocated (two
replicas, prefix-aware routing, the prefix cache only); pd-prefill (one prefill and one
decode replica, a KV store with decode write-back, stored prefixes read on the prefill
side, Mooncake's Conductor); dualpath (the same, stored prefixes read on the side whose
read ends first, DualPath's scheduler). Both P/D setups give each replica a storage link
of ``--storage-mbps`` (``storage_bytes_per_s``: DualPath's storage NIC); reads and
write-back pay it. Memory is equal: two engines' worth of ``--kv-cache-mib`` in every setup,
split evenly for colocated, by role for P/D (``--pd-decode-share`` to decode: it holds every
turn in flight while prefill holds only the prompts it is prefilling; ``agent_setups``).

One run = one app started, the warm-up, every trajectory, the app deleted; runs interleaved
(setup order rotated), ``--repeats`` each, medians over runs. Per setup: turn TTFT p50/p99
(all turns, later turns), trajectory completion (first send to last token), goodput (turns/s
within ``--ttft-slo``), the prompt tokens cached (``usage``), the client's mean TTFT beside
the replicas' own (``/metrics``, from arrival, a decode-room wait included; the gap is the
HTTP and relay path and waits after 429s, counted by reason), the turns that waited for
decode room (``policies.decode_wait``) and their mean wait, tool calls. Last line: ``agent
turn-ttft-p50 colocated/dualpath: <ratio>`` (median of the per-repeat ratios of TTFT p50).

    flock /tmp/bench.lock python bench/agents.py [--repeats 3] [--concurrency 16]
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.agent_setups import MODEL_NAME, SETUPS, app_config, expected_replicas, pd_kv_split
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import interleaved, medians
from bench.local_serve import ServeHost, deploy, local_serve
from bench.serve_records import TokenClock
from bench.sse import sse_chunks
from sim.agent_trajectories import (
    AgentTrajectory,
    AgentTurn,
    build_trajectories,
    scaled,
    summary,
)
from sim.metrics import percentile
from sim.traces import load_trace

APP = "bench-agents"


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
    tool_calls: int = 0  # answers that were tool calls
    reasons: dict[str, int] = field(default_factory=dict)  # 429s by reason
    server_ttft: float = float("nan")  # the replicas' own mean TTFT (their metric), seconds
    queued: float = 0.0  # turns that waited for decode room (P/D), and their mean wait (s)
    queue_wait: float = 0.0

    def metrics(self, slo: float) -> dict[str, float]:
        ttft = [s.ttft * 1e3 for s in self.turns]
        later = [s.ttft * 1e3 for s in self.turns if s.turn > 0]
        prompt = sum(s.prompt_tokens for s in self.turns)
        return {
            "turns": len(self.turns),
            "duration_s": self.duration,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": percentile(ttft, 99),
            "later_ttft_p50_ms": statistics.median(later) if later else float("nan"),
            "later_ttft_p99_ms": percentile(later, 99),
            "completion_p50_s": statistics.median(self.completions),
            "completion_max_s": max(self.completions),
            "goodput_turns_s": sum(s.ttft <= slo for s in self.turns) / self.duration,
            "cached_share": sum(s.cached_tokens for s in self.turns) / prompt if prompt else 0.0,
            "refused": self.refused,
            "tool_calls": self.tool_calls,
            "mean_ttft_ms": statistics.fmean(ttft),
            "server_mean_ttft_ms": self.server_ttft * 1e3,
            "queued": self.queued,
            "queue_wait_ms": self.queue_wait * 1e3,
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


# The agent's one tool. A turn followed by a tool step names it in tool_choice, so its answer
# is a call whose arguments the server constrains to this schema (an enum: a short call).
TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the agent's sandbox.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "enum": ["ls", "cat", "grep", "pytest"]}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
}
CALL_TOKENS = 96  # a forced call's max_tokens: the hermes block is ~65 bytes (1 token each)
WORDS = "the of agent tool file test run read grep build error line code patch diff log".split()


def text_of(seed: int, n: int) -> str:
    """``n`` characters of words (the bench model's tokenizer: one token per byte)."""
    rng = random.Random(seed)
    out = ""
    while len(out) < n:
        out += rng.choice(WORDS) + " "
    return out[:n]


class Refused(Exception):
    def __init__(self, retry_after: float, reason: str) -> None:
        self.retry_after = retry_after
        self.reason = reason


def refusal_reason(body: bytes) -> str:
    """The Conductor's reason in a 429's message ("overloaded (decode_full): ...")."""
    text = body.decode(errors="replace")
    start = text.find("overloaded (")
    if start < 0:
        return "other"
    start += len("overloaded (")
    return text[start : text.find(")", start)]


@dataclass
class Answer:
    ttft: float
    e2e: float
    token_ids: list[int]
    cached: int
    prompt_tokens: int
    content: str
    calls: list[dict[str, Any]]  # OpenAI tool_calls, arguments as their streamed text


class Agent:
    """The agents' client of the endpoint: streamed chat completions, TTFT per turn (from
    the first send, retries after a 429 included; the first chunk that carries token ids,
    so a tool call's first token counts, not its parsed name)."""

    def __init__(self, base_url: str) -> None:
        self.refused = 0
        self.reasons: Counter[str] = Counter()  # 429s by the Conductor's reason
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
        )

    async def turn(
        self, messages: list[dict[str, Any]], max_tokens: int, session: str, call: bool
    ) -> Answer:
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": messages,
            "tools": [TOOL],
            "max_tokens": CALL_TOKENS if call else max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "session_id": session,
        }
        if call:  # constrained to one call of the tool
            body["tool_choice"] = {"type": "function", "function": {"name": "bash"}}
            body["parallel_tool_calls"] = False
        else:  # the answer is text (random weights call no tool unforced)
            body["tool_choice"] = "auto"
            body["ignore_eos"] = True
        clock = TokenClock()  # from the first send: a refused turn's wait counts
        while True:
            try:
                return await self._stream(body, clock)
            except Refused as e:  # 429: an agent retries after Retry-After
                self.refused += 1
                self.reasons[e.reason] += 1
                await asyncio.sleep(e.retry_after)

    async def _stream(self, body: dict[str, Any], clock: TokenClock) -> Answer:
        out: list[int] = []
        usage: dict[str, Any] = {}
        content = ""
        calls: dict[int, dict[str, Any]] = {}
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                wait = min(1.0, float(r.headers.get("retry-after", "0.1")))
                raise Refused(wait, refusal_reason(await r.aread()))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for chunk in sse_chunks(r.aiter_lines()):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or ():
                    delta = c.get("delta") or {}
                    content += delta.get("content") or ""
                    for d in delta.get("tool_calls") or ():
                        call = calls.setdefault(d["index"], {"type": "function"})
                        call.setdefault("id", d.get("id"))
                        fn = call.setdefault("function", {"name": None, "arguments": ""})
                        fn["name"] = fn["name"] or (d.get("function") or {}).get("name")
                        fn["arguments"] += (d.get("function") or {}).get("arguments") or ""
                    if c.get("token_ids"):
                        out += c["token_ids"]
                        clock.tick()
        end = time.perf_counter()
        if clock.first is None:
            raise RuntimeError("the stream carried no tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        prompt = usage.get("prompt_tokens", 0)
        ordered = [calls[i] for i in sorted(calls)]
        return Answer(
            clock.first - clock.start, end - clock.start, out, cached, prompt, content, ordered
        )

    async def close(self) -> None:
        await self.client.aclose()


async def run_agents(
    url: str,
    setup: str,
    trajs: list[AgentTrajectory],
    concurrency: int,
    seed: int,
    ramp_s: float = 0.0,
) -> AgentRun:
    """``concurrency`` agents, the k-th starting ``k * ramp_s / concurrency`` s in."""
    run = AgentRun(setup)
    agent = Agent(url)
    todo = iter(range(len(trajs)))

    async def one_trajectory(i: int) -> None:
        t = trajs[i]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": text_of(seed * 1_000_003 + i, t.first)}
        ]
        start = time.perf_counter()
        call_id = None
        for k, step in enumerate(t.turns):
            if k:
                await asyncio.sleep(step.pause_s)
                text = text_of(seed * 1_000_003 + i * 1000 + k, step.append)
                if call_id is not None:  # the tool's output answers the previous call
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
                else:
                    messages.append({"role": "user", "content": text})
            call = k + 1 < len(t.turns) and t.turns[k + 1].tool
            a = await agent.turn(list(messages), step.output, f"agent-{seed}-{i}", call)
            if call and not a.calls:
                raise RuntimeError(f"a forced tool call came back without one: {a.content!r}")
            if a.calls:
                call_id = a.calls[0]["id"]
                messages.append({"role": "assistant", "content": None, "tool_calls": a.calls})
            else:
                call_id = None
                messages.append({"role": "assistant", "content": a.content})
            run.outputs[(i, k)] = a.token_ids
            run.tool_calls += len(a.calls)
            run.turns.append(TurnSample(i, k, a.ttft, a.e2e, a.prompt_tokens, a.cached))
        run.completions.append(time.perf_counter() - start)

    async def worker(w: int) -> None:
        await asyncio.sleep(w * ramp_s / concurrency)
        for i in todo:  # one shared iterator: each trajectory goes to one agent
            await one_trajectory(i)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await agent.close()
    run.duration = time.perf_counter() - t0
    run.refused = agent.refused
    run.reasons = dict(agent.reasons)
    return run


# the replicas' TTFT histogram (arrival to first token) and the P/D decode-room waits
SUMS = (
    "meridian:time_to_first_token_seconds_sum",
    "meridian:time_to_first_token_seconds_count",
    "meridian:pd_decode_wait_seconds_total",
    "meridian:pd_decode_waits_total",
)


def metric_sums(url: str) -> list[float]:
    """Each of ``SUMS`` summed over the replicas (0 where absent)."""
    out = dict.fromkeys(SUMS, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.split("{")[0] in out:
            out[name.split("{")[0]] += float(value)
    return list(out.values())


# a forced call, its tool's output, a text answer, a user turn
WARM_UP = AgentTrajectory(
    64,
    (AgentTurn(0, 4, 0.0, False), AgentTurn(40, 4, 0.0, True), AgentTurn(20, 4, 0.0, False)),
    "warm-up",
)


def one_run(
    setup: str,
    host: ServeHost,
    model_dir: str,
    trajs: list[AgentTrajectory],
    args: argparse.Namespace,
) -> AgentRun:
    from ray import serve

    url = deploy(host, app_config(setup, model_dir, args), expected_replicas(setup), APP)
    try:
        asyncio.run(run_agents(url, setup, [WARM_UP], 1, seed=-1))  # compiles each path once
        before = metric_sums(url)
        run = asyncio.run(run_agents(url, setup, trajs, args.concurrency, args.seed, args.ramp))
        time.sleep(2.2)  # an idle replica pushes its last metrics within its heartbeat
        ttft_s, ttfts, wait_s, waits = map(float.__sub__, metric_sums(url), before)
        if ttfts > 0:
            run.server_ttft = ttft_s / ttfts
        run.queued, run.queue_wait = waits, wait_s / waits if waits else 0.0
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
    ("tool-call answers", "tool_calls", "{:.0f}"),
    ("429s retried", "refused", "{:.0f}"),
    ("turns queued for decode room", "queued", "{:.0f}"),
    ("mean decode-room wait (ms)", "queue_wait_ms", "{:.0f}"),
    ("run time (s)", "duration_s", "{:.1f}"),
)


def print_table(results: dict[str, list[AgentRun]], slo: float) -> dict[str, dict[str, float]]:
    meds = {}
    for setup, runs in results.items():
        per = [r.metrics(slo) for r in runs]
        meds[setup] = medians(per)
    print(f"{'median of runs':32s}" + "".join(f"{s:>13s}" for s in results))
    for label, key, fmt in ROWS:
        print(f"{label:32s}" + "".join(f"{fmt.format(meds[s][key]):>13s}" for s in results))
    return meds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16, help="agents at once")
    ap.add_argument("--ramp", type=float, default=8.0, help="seconds over which agents start")
    ap.add_argument("--turns", type=int, default=5, help="the first N turns of each")
    ap.add_argument("--length-scale", type=float, default=1 / 8)
    ap.add_argument("--max-first", type=int, default=768, help="first prompt, at most")
    ap.add_argument("--max-output", type=int, default=16, help="tokens per text answer, at most")
    ap.add_argument("--pause-scale", type=float, default=3.0)
    ap.add_argument("--max-pause", type=float, default=12.0, help="seconds, per pause")
    ap.add_argument("--kv-cache-mib", type=int, default=64, help="KV per engine")
    ap.add_argument("--store-mib", type=int, default=1024, help="the KV store's DRAM")
    ap.add_argument(
        "--pd-decode-share",
        type=float,
        default=0.75,
        help="P/D: the decode replica's share of the two engines' KV (prefill: the rest)",
    )
    ap.add_argument(
        "--storage-mbps",
        type=float,
        default=100.0,
        help="MB/s of each P/D replica's storage link (0: not limited)",
    )
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="seconds, for goodput")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", help="write the medians here (for python -m sim agents --live)")
    args = ap.parse_args()
    if not 0 < args.pd_decode_share < 1:
        ap.error("--pd-decode-share must be in (0, 1)")

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
    kv_token = 2 * MODEL["num_hidden_layers"] * MODEL["hidden_size"] * 4  # fp32 K and V
    kv_token = kv_token * MODEL["num_key_value_heads"] // MODEL["num_attention_heads"]
    engine_tokens = (args.kv_cache_mib << 20) // kv_token
    live = sum(t.prompt_lengths()[-1] for t in trajs[: args.concurrency])
    prefill_kv, decode_kv = (b // kv_token for b in pd_kv_split(args))
    longest = max(t.prompt_lengths()[-1] for t in trajs)
    if longest + args.max_output > prefill_kv:
        sys.exit(f"--pd-decode-share leaves prefill {prefill_kv} tokens of KV < {longest} + answer")
    print(
        f"regime: KV per engine {engine_tokens} tokens; the first {args.concurrency} agents' "
        f"final contexts {live} tokens ({live / engine_tokens:.1f}x one engine's KV); "
        f"storage links {args.storage_mbps:g} MB/s per P/D replica; P/D KV prefill "
        f"{prefill_kv} / decode {decode_kv} tokens (longest prompt {longest})",
        flush=True,
    )
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["RAY_CGRAPH_buffer_size_bytes"] = str(1 << 24)
    with local_serve(env) as host:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(write_bench_model(Path(tmp) / "bench"))

            def timed_run(setup: str, rep: int) -> AgentRun:
                run = one_run(setup, host, model_dir, trajs, args)
                m = run.metrics(args.ttft_slo)
                print(
                    f"[rep {rep}] {setup:>10s}: TTFT p50 {m['ttft_p50_ms']:.0f} ms p99 "
                    f"{m['ttft_p99_ms']:.0f} ms, completion p50 "
                    f"{m['completion_p50_s']:.1f} s, goodput {m['goodput_turns_s']:.2f} "
                    f"turns/s, cached {m['cached_share']:.0%}, 429s {run.reasons}, queued "
                    f"{run.queued:.0f} (mean {run.queue_wait:.2f} s), "
                    f"run {run.duration:.1f} s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                return run

            results = interleaved(args.setups, args.repeats, timed_run)
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


if __name__ == "__main__":
    main()
