"""Chat workloads for ``bench/serve.py --dataset sharegpt|mtbench``, sent as ``vllm bench
serve`` sends them: ``POST /v1/chat/completions`` through the ``openai`` client, streamed
with ``stream_options.include_usage``, greedy, the server's own chat template.

- ShareGPT: one turn, the conversation's first human turn; ``max_tokens`` is the token count
  of the dataset's reply up to ``--max-output-tokens`` (``sim/datasets.py``: vLLM's filter
  and seeded sampling), with ``ignore_eos`` so every server writes that many tokens.
- MT-bench: two turns. The second is sent once the first has ended, with the first turn's
  question and the model's own answer (as it streamed it) before the follow-up, so the
  server can serve that prefix from its cache; ``max_tokens`` is ``--max-output-tokens``
  and the model stops at EOS.

Arrivals: closed loop (``rate`` None: N clients, each sending its next conversation when its
last one ends) or Poisson at ``rate`` conversations per second with at most N in flight
(``vllm bench serve --request-rate R --max-concurrency N``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.client_wait import LoopWatch
from bench.interleave import invocation_seed, median_ratio, turns
from bench.serve_records import Sample, TokenClock
from bench.session import others_paused


@dataclass(frozen=True)
class Conversation:
    """User turns sent in order, each after the answer to the one before."""

    turns: tuple[str, ...]
    max_tokens: tuple[int, ...]  # per turn
    ignore_eos: bool


def sharegpt_conversations(
    count: int, encode: Callable[[str], list[int]], seed: int, max_output: int, ignore_eos: bool
) -> list[Conversation]:
    from sim.datasets import sample_sharegpt

    reqs = sample_sharegpt(count, encode, seed=seed, max_output=max_output)
    if len(reqs) < count:
        raise ValueError(f"ShareGPT gave {len(reqs)} requests after filtering, not {count}")
    return [Conversation((r.prompt,), (r.output_len,), ignore_eos) for r in reqs]


def mtbench_conversations(seed: int, max_output: int) -> list[Conversation]:
    """All 80 questions in a seeded order."""
    from sim.datasets import load_mtbench

    qs = list(load_mtbench())
    random.Random(seed).shuffle(qs)
    return [Conversation(q.turns, (max_output, max_output), False) for q in qs]


def split_runs(items: Sequence[Conversation], runs: int, per_run: int) -> list[list[Conversation]]:
    """``runs`` slices of ``per_run`` items, disjoint while the items last (so no run finds
    another run's prompts in a cache), then wrapping around."""
    return [[items[(r * per_run + i) % len(items)] for i in range(per_run)] for r in range(runs)]


Turn = Callable[[list[dict[str, str]], int, bool, int], Awaitable[tuple[Sample, str]]]


async def converse(turn: Turn, conv: Conversation) -> list[Sample]:
    """``conv``'s user turns in order, each after the answer to the one before:
    ``turn(messages, max_tokens, ignore_eos, turn number)`` gives one turn's sample and the
    answer's text."""
    messages: list[dict[str, str]] = []
    samples = []
    for i, (text, max_tokens) in enumerate(zip(conv.turns, conv.max_tokens, strict=True)):
        messages.append({"role": "user", "content": text})
        sample, answer = await turn(messages, max_tokens, conv.ignore_eos, i + 1)
        messages.append({"role": "assistant", "content": answer})
        samples.append(sample)
    return samples


class ChatClient:
    """One OpenAI-compatible server, driven through the ``openai`` client."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        import httpx
        from openai import AsyncOpenAI

        self.model = model
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
            timeout=600.0,
        )
        self.client = AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=api_key or "none",
            timeout=600.0,
            max_retries=0,
            http_client=self.http,
        )

    async def turn(
        self, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool, turn: int
    ) -> tuple[Sample, str]:
        """One streamed chat completion: its timings and the answer's text."""
        extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
        clock = TokenClock()
        stream = await self.client.chat.completions.create(
            model=self.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            text = "".join(c.delta.content or "" for c in chunk.choices if c.delta)
            if not text:
                continue
            clock.tick()
            parts.append(text)
        end = time.perf_counter()
        if usage is None:
            raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
        # an answer with no text (EOS at once): its end is its first token
        first = end if clock.first is None else clock.first
        t0, itls = clock.start, clock.itls
        details = usage.prompt_tokens_details
        sample = Sample(
            first - t0,
            end - t0,
            itls,
            usage.completion_tokens,
            turn=turn,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=(details.cached_tokens or 0) if details is not None else None,
        )
        return sample, "".join(parts)

    async def conversation(self, conv: Conversation) -> list[Sample]:
        return await converse(self.turn, conv)

    async def prefix_cache_hits(self) -> float | None:
        """The server's prefix-cache hit tokens so far: the ``*prefix_cache_hits_total``
        counters of its ``/metrics`` summed (vLLM's and Meridian's name), or None if it
        exports none."""
        r = await self.http.get(self.base_url + "/metrics")
        if r.status_code != 200:
            return None
        return prefix_hits_total(r.text)

    async def close(self) -> None:
        await self.client.close()


def prefix_hits_total(exposition: str) -> float | None:
    """The sum of a Prometheus text exposition's ``*prefix_cache_hits_total`` samples."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if not line.startswith("#")
        and line.split("{", 1)[0].split(" ", 1)[0].endswith("prefix_cache_hits_total")
    ]
    return sum(values) if values else None


def cached_prompt_tokens(
    samples: Sequence[Sample], before: float | None, after: float | None
) -> float:
    """A run's prompt tokens served from the server's cache: its usage's details where every
    sample had them, else the change in its ``/metrics`` counter, else NaN (not known)."""
    reported = [s.cached_tokens for s in samples]
    if samples and all(c is not None for c in reported):
        return float(sum(c for c in reported if c is not None))
    if before is not None and after is not None:
        return after - before
    return float("nan")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``count`` conversations arrives."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def drive(
    one: Callable[[Conversation], Awaitable[list[Sample]]],
    convs: list[Conversation],
    concurrency: int,
    rate: float | None = None,
    seed: int = 0,
) -> tuple[float, list[Sample]]:
    """Run every conversation, at most ``concurrency`` at a time; closed loop without
    ``rate``, else Poisson arrivals. Returns (wall seconds, every turn's sample)."""
    samples: list[Sample] = []
    t0 = time.perf_counter()
    if rate is None:
        todo = iter(convs)

        async def client() -> None:
            for conv in todo:  # one shared iterator: each conversation goes to one client
                samples.extend(await one(conv))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    else:
        slots = asyncio.Semaphore(concurrency)

        async def arrive(at: float, conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with slots:
                samples.extend(await one(conv))

        arrivals = poisson_arrivals(len(convs), rate, seed)
        await asyncio.gather(*(arrive(a, c) for a, c in zip(arrivals, convs, strict=True)))
    return time.perf_counter() - t0, samples


# -- the run: sides interleaved, medians of paired ratios ----------------------------------------
def paired(runs_a: list[Any], runs_b: list[Any], value: Callable[[Any], float]) -> float:
    """``median_ratio`` of value(a) over value(b), runs paired by repeat."""
    return median_ratio(map(value, runs_a), map(value, runs_b))


async def run_chat(
    args: Any, sides: list[tuple[str, ChatClient]], sessions: Mapping[str, int] | None = None
) -> None:
    """Every (streams, repeat) gets its own conversations, the same for every side; the
    sides take turns, the first rotating with the repeat. ``sessions`` (side -> the session
    of the server this bench started for it): while a side runs, the others' are stopped
    (``bench/session.others_paused``)."""
    from bench.serve_records import Run, median_metrics, print_table

    per_run: int = args.num_prompts
    runs = len(args.concurrency) * args.repeats
    seed = invocation_seed(args.seed, f"{args.dataset} conversations")
    if args.dataset == "sharegpt":
        from models.pretrained import resolve_model
        from models.tokenizer import load_tokenizer

        encode = load_tokenizer(resolve_model(args.tokenizer or args.model_path)).encode
        convs = sharegpt_conversations(
            runs * per_run, encode, seed, args.max_output_tokens, not args.stop_at_eos
        )
    else:
        convs = mtbench_conversations(seed, args.max_output_tokens)
        if runs * per_run > len(convs):
            print(f"note: {runs} runs of {per_run} conversations reuse MT-bench's {len(convs)}")
    slices = split_runs(convs, runs, per_run)
    hello = Conversation(("Say hello.",), (8,), False)
    for _, client in sides:
        await drive(client.conversation, [hello] * 2, 2)
    ttft_slo, tpot_slo = args.ttft_slo / 1e3, args.tpot_slo / 1e3
    arrivals = "closed loop" if args.request_rate is None else f"Poisson {args.request_rate}/s"
    results: dict[tuple[str, int], list[Run]] = {}
    for ci, c in enumerate(args.concurrency):
        for rep in range(args.repeats):
            for name, client in turns(sides, rep):
                run = Run(name, c, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
                hits_before = await client.prefix_cache_hits()
                watch = LoopWatch()
                with others_paused(sessions or {}, name):
                    watching = asyncio.ensure_future(watch.run())
                    run.duration, run.samples = await drive(
                        client.conversation,
                        slices[ci * args.repeats + rep],
                        c,
                        args.request_rate,
                        seed=1000 * rep + c,
                    )
                    watching.cancel()
                    await asyncio.gather(watching, return_exceptions=True)
                run.client_lag = watch.max_lag
                run.client_runqueue = float("nan") if watch.runqueue_s is None else watch.runqueue_s
                run.client_cpu = float("nan") if watch.cpu_s is None else watch.cpu_s
                run.input_tokens = sum(s.prompt_tokens for s in run.samples)
                hits_after = await client.prefix_cache_hits()
                run.cached_tokens = cached_prompt_tokens(run.samples, hits_before, hits_after)
                results.setdefault((name, c), []).append(run)
                m = run.metrics()
                print(
                    f"[rep {rep}] {c:>3} streams {name:>9} {run.throughput:5.2f} req/s, goodput "
                    f"{run.goodput:5.2f}, median TTFT {m['median_ttft']:.0f} ms, TPOT "
                    f"{m['median_tpot']:.1f} ms, {run.cached_tokens:.0f} of {run.input_tokens} "
                    f"prompt tokens from cache ({arrivals}; {load()})",
                    flush=True,
                )
    print()
    slo = f"SLO TTFT {args.ttft_slo:.0f} ms, TPOT {args.tpot_slo:.0f} ms"
    for c in args.concurrency:
        print_table(f"{args.dataset}, {c} streams", {n: results[(n, c)] for n, _ in sides})
    print(f"goodput: requests that met the {slo}, per second")
    first = sides[0][0]
    if len(sides) > 1:
        peer = sides[1][0]
        print()
        head = ["streams", f"{first} req/s", f"{peer} req/s", "req/s", "goodput", "TPOT p50"]
        head.append("ITL p99")
        if args.dataset == "mtbench":
            head.append("2nd-turn TTFT p50")
        print(" | ".join(head) + f"   ({first}/{peer}: medians of paired ratios)")
        for c in args.concurrency:
            a, b = results[(first, c)], results[(peer, c)]
            ma, mb = median_metrics(a), median_metrics(b)
            cells = [
                f"{c}",
                f"{ma['req_s']:.2f}",
                f"{mb['req_s']:.2f}",
                f"{paired(a, b, lambda r: r.throughput):.2f}",
                f"{paired(a, b, lambda r: r.goodput):.2f}",
                f"{paired(a, b, lambda r: r.metrics()['median_tpot']):.2f}",
                f"{paired(a, b, lambda r: r.metrics()['p99_itl']):.2f}",
            ]
            if args.dataset == "mtbench":
                cells.append(f"{paired(a, b, lambda r: r.metrics()['median_ttft_turn2']):.2f}")
            print(" | ".join(cells))
        for name, _ in sides[2:]:
            for c in args.concurrency:
                ratio = paired(results[(first, c)], results[(name, c)], lambda r: r.throughput)
                print(f"{first}/{name} req/s at {c} streams: {ratio:.2f}")
        top = max(args.concurrency)
        a, b = results[(first, top)], results[(peer, top)]
        goodput = paired(a, b, lambda r: r.goodput)
        if args.dataset == "mtbench":
            print(f"mtbench goodput {first}/{peer} at {top} streams: {goodput:.2f}")
            ttft2 = paired(a, b, lambda r: r.metrics()["median_ttft_turn2"])
            print(f"mtbench second-turn TTFT {first}/{peer} at {top} streams: {ttft2:.2f}")
        else:
            print(f"{args.dataset} goodput {first}/{peer} at {top} streams: {goodput:.2f}")
    else:
        top = max(args.concurrency)
        good = median_metrics(results[(first, top)])["goodput"]
        print(f"{args.dataset} goodput {first} at {top} streams: {good:.2f} req/s")


def load() -> str:
    import os

    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f} {five:.1f} {fifteen:.1f}"
