"""The random-prompt workload of ``bench/serve.py``: N closed-loop streaming clients of
``POST /v1/completions`` (``HttpClient``), and the interleaving of several sides over the
concurrency levels and repeats (``run_sides``). A side is one server's client, its engine's
inter-token metric (the replica's ``meridian:inter_token_latency_seconds`` from
``/metrics``) and, for ``--cpu-hog``, a CPU-bound process beside it while it runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

import httpx

from bench.app_probe import served_model, wait_for
from bench.bench_model import MODEL
from bench.cpu_hog import cpu_hog
from bench.interleave import invocation_seed, median_ratio, turns
from bench.serve_profile import CpuProfile
from bench.serve_records import Run, Sample, TokenClock, print_table
from bench.session import others_paused
from bench.sse import sse_chunks


def prompts_for(seed: object, count: int, length: int) -> list[list[int]]:
    rng = random.Random(str(seed))
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(length)] for _ in range(count)]


async def closed_loop(
    one: Callable[[list[int]], Awaitable[Sample]], prompts: list[list[int]], concurrency: int
) -> tuple[float, list[Sample]]:
    """``concurrency`` clients, each sending its next prompt as soon as its last one ends."""
    todo = iter(prompts)
    samples: list[Sample] = []

    async def client() -> None:
        for prompt in todo:  # one shared iterator: each prompt goes to one client
            samples.append(await one(prompt))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0, samples


# -- the HTTP side --------------------------------------------------------------------------
class HttpClient:
    def __init__(
        self, base_url: str, model: str, new_tokens: int, api_key: str | None, token_ids: bool
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
            headers=headers,
        )
        self.model = model
        self.new_tokens = new_tokens
        self.token_ids = token_ids

    async def one(self, prompt: list[int]) -> Sample:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.token_ids:  # every token's chunk, even one that completes no character
            body["return_token_ids"] = True
        clock = TokenClock()
        tokens = 0
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
            async for chunk in sse_chunks(r.aiter_lines()):
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or ()
                if not any(c.get("text") or c.get("token_ids") for c in choices):
                    continue
                clock.tick()
        end = time.perf_counter()
        if clock.first is None:
            raise RuntimeError("the stream carried no tokens")
        if not tokens:
            raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
        return Sample(clock.first - clock.start, end - clock.start, clock.itls, tokens)

    async def close(self) -> None:
        await self.client.aclose()


ITL_METRIC = "meridian:inter_token_latency_seconds"


def itl_totals(lines: Iterable[tuple[str, float]]) -> tuple[float, float]:
    """(sum, count) of the engine's inter-token latency histogram, over every replica."""
    total, count = 0.0, 0.0
    for name, value in lines:
        if name == ITL_METRIC + "_sum":
            total += value
        elif name == ITL_METRIC + "_count":
            count += value
    return total, count


async def http_itl(client: httpx.AsyncClient) -> tuple[float, float]:
    r = await client.get("/metrics")
    pairs = []
    for line in r.text.splitlines():
        if line.startswith(ITL_METRIC):
            name, _, value = line.rpartition(" ")
            pairs.append((name.split("{")[0], float(value)))
    return itl_totals(pairs)


def mean_between(a: tuple[float, float], b: tuple[float, float]) -> float:
    return (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else float("nan")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f} {five:.1f} {fifteen:.1f}"


def requests_at(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_requests, args.per_stream * concurrency)


Itl = Callable[[], Awaitable[tuple[float, float]]]


async def no_itl() -> tuple[float, float]:
    return (0.0, 0.0)


class Side:
    """One server in the interleaving: its client, its engine-ITL metric and, with ``hog``,
    a CPU-bound process at nice 0 beside it while it runs (``--cpu-hog``)."""

    def __init__(
        self,
        name: str,
        one: Callable[[list[int]], Awaitable[Sample]],
        itl: Itl,
        settle: float = 0.3,
        hog: bool = False,
    ) -> None:
        self.name, self.one, self.itl, self.settle, self.hog = name, one, itl, settle, hog


def http_side(name: str, client: HttpClient, hog: bool = False) -> Side:
    # an idle replica pushes its last metrics within its 2 s heartbeat
    return Side(name, client.one, lambda: http_itl(client.client), 2.2, hog)


async def run_with_peer(
    args: argparse.Namespace,
    sides: list[Side],
    own: HttpClient,
    profile: CpuProfile | None = None,
    sessions: Mapping[str, int] | None = None,
) -> tuple[dict[tuple[str, int], list[Run]], bool]:
    """``run_sides``, with ``--peer-url``'s server as one more side named ``peer``; closes
    ``own`` and the peer's client after. Returns the results and whether a peer ran."""
    peer = None
    if args.peer_url:
        await asyncio.to_thread(
            wait_for,
            lambda: served_model(args.peer_url),
            f"the peer at {args.peer_url} did not answer",
            60,
        )
        token_ids = not args.no_token_ids
        peer = HttpClient(args.peer_url, args.peer_model, args.new_tokens, None, token_ids)
        sides = [*sides, Side("peer", peer.one, no_itl)]
    try:
        return await run_sides(args, sides, profile, sessions), peer is not None
    finally:
        await own.close()
        if peer is not None:
            await peer.close()


async def run_sides(
    args: argparse.Namespace,
    sides: list[Side],
    profile: CpuProfile | None = None,
    sessions: Mapping[str, int] | None = None,
) -> dict[tuple[str, int], list[Run]]:
    """Every concurrency level, ``--repeats`` times, the sides taking turns (the one that
    goes first rotating with the repeat); the same prompts for every side of a repeat.
    ``profile`` reads every thread's CPU time around each run (``--cpu-profile``).
    ``sessions`` (side -> the session of the server this bench started for it): while a
    side runs, the others' are stopped (``bench/session.others_paused``)."""
    seed = invocation_seed(args.seed, "random prompts")
    warm = prompts_for(-1, 4, args.prompt_len)
    for side in sides:
        if not side.hog:
            await closed_loop(side.one, warm, 4)
    results: dict[tuple[str, int], list[Run]] = {}
    for c in args.concurrency:
        for rep in range(args.repeats):
            for side in turns(sides, rep):
                prompts = prompts_for((seed, rep, c), requests_at(args, c), args.prompt_len)
                run = Run(side.name, c, input_tokens=sum(map(len, prompts)))
                before = await side.itl()
                done: list[tuple[float, int]] = []  # (seconds, output tokens) for the profile
                with (  # the hog outside the profile's reads, so they count it
                    others_paused(sessions or {}, side.name),
                    cpu_hog() if side.hog else contextlib.nullcontext(),
                    profile.watch(side.name, c, done) if profile else contextlib.nullcontext(),
                ):
                    run.duration, run.samples = await closed_loop(side.one, prompts, c)
                    done.append((run.duration, sum(s.output_tokens for s in run.samples)))
                await asyncio.sleep(side.settle)
                run.engine_itl = mean_between(before, await side.itl())
                results.setdefault((side.name, c), []).append(run)
                print(
                    f"[rep {rep}] {c:>3} streams {side.name:>10} {run.throughput:5.2f} req/s, "
                    f"median ITL {run.metrics()['median_itl']:.0f} ms, engine ITL "
                    f"{run.engine_itl * 1e3:.0f} ms ({load()})",
                    flush=True,
                )
    print()
    for c in args.concurrency:
        print_table(f"{c} streams", {s.name: results[(s.name, c)] for s in sides})
        if profile:
            itl = {
                s.name: statistics.median(r.engine_itl for r in results[(s.name, c)]) for s in sides
            }
            profile.print(c, itl)
    print()
    return results


def paired_ratio(results: dict[tuple[str, int], list[Run]], a: str, b: str, c: int) -> float:
    """The median over repeats of side a's req/s over side b's, runs paired by repeat."""
    return median_ratio(
        (r.throughput for r in results[(a, c)]), (r.throughput for r in results[(b, c)])
    )


def median_rate(results: dict[tuple[str, int], list[Run]], side: str, c: int) -> float:
    return statistics.median(r.throughput for r in results[(side, c)])
