"""``bench/pd_isolation.py --http``: the isolation scenario through the public API.

Two apps started as a new user starts them (``bench/serve_defaults.py``: ``serve run`` with
the Makefile's environment, a config of only ``model`` and one group), both up at once:

- colocated: the group ``{name: main}`` (its default replica count);
- P/D: the group ``{name: pd, num_prefill: 1, num_decode: 1}``.

Each run: eight short prompts stream from ``POST /v1/completions`` (``return_token_ids``,
so every token's chunk is timed as it reaches the client); once each has 8 tokens the long
prompt is sent; the runs end at the long prompt's first token, and the short streams are
closed (the server aborts them). Gaps between a short request's consecutive chunks are
"before" when the later chunk came before the long prompt was sent, "during" when it came
between then and the long prompt's first token. The apps take turns (A, B, A, B, ...);
while one runs, every process of the other's session is stopped (``bench/session.paused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.interleave import interleaved
from bench.pd_profile import GAP_X, Profiler, RunProfile, decode_step_times, print_table, split_gaps
from bench.session import paused
from bench.sse import sse_chunks

Prompts = Callable[[int], tuple[list[list[int]], list[int]]]
Gaps = Callable[[list[list[float]], float, float], tuple[list[float], list[float]]]

GROUPS = {"colocated": "{name: main}", "P/D": "{name: pd, num_prefill: 1, num_decode: 1}"}


async def stream_times(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    out: list[float],
    arrived: Callable[[], None] = lambda: None,
) -> None:
    """Appends the arrival time of each chunk that carries tokens to ``out``, then calls
    ``arrived()``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for chunk in sse_chunks(r.aiter_lines()):
            choices = chunk.get("choices") or ()
            n = sum(len(c.get("token_ids") or ()) for c in choices)
            if n:
                out.extend([time.monotonic()] * n)
                arrived()


TIMEOUT_S = 300.0  # one run's limit: a stream that stalls is an error, not a hang


async def one_run(
    url: str,
    model: str,
    prompts: Prompts,
    seed: int,
    short_tokens: int,
    before_tokens: int,
    profiler: Profiler | None = None,
) -> tuple[list[list[float]], float, float]:
    """(each short request's token times, the long prompt's send time, its first token).
    ``profiler`` is told when every short request has its first token (``start``), when the
    long prompt is sent (``arrival``) and when its first token came (``first``)."""
    mark = profiler.mark if profiler is not None else lambda name: None
    short, long = prompts(seed)
    times: list[list[float]] = [[] for _ in short]
    started, ready, answered = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def arrived() -> None:  # on the streams' tasks: no polling loop wakes the client
        fewest = min(len(t) for t in times)
        if fewest >= 1 and not started.is_set():
            started.set()
            mark("start")
        if fewest >= before_tokens:
            ready.set()

    async def until(event: asyncio.Event, tasks: list[asyncio.Task[None]], what: str) -> None:
        """Wait for ``event``; a stream in ``tasks`` that ends first raises what ended it."""
        waiter = asyncio.create_task(event.wait())
        await asyncio.wait([waiter, *tasks], timeout=TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if event.is_set():
            return
        for t in tasks:
            if t.done():
                t.result()  # raises what ended a stream early
                raise RuntimeError(f"{what}: a stream ended first")
        raise TimeoutError(f"no {what} within {TIMEOUT_S:.0f} s")

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        tasks = [
            asyncio.create_task(stream_times(client, model, p, short_tokens, t, arrived))
            for p, t in zip(short, times, strict=True)
        ]
        long_task: asyncio.Task[None] | None = None
        try:
            await until(ready, tasks, f"{before_tokens} tokens of every short request")
            long_times: list[float] = []
            arrival = time.monotonic()
            mark("arrival")
            long_task = asyncio.create_task(
                stream_times(client, model, long, 2, long_times, answered.set)
            )
            await until(answered, [long_task], "first token of the long prompt")
            first = long_times[0]
            mark("first")
        finally:
            for t in [*tasks, long_task]:
                if t is not None:
                    t.cancel()
            for t in [*tasks, long_task]:
                if t is not None:
                    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                        await t
    await asyncio.sleep(1.0)  # the server aborts the closed streams and frees their blocks
    return times, arrival, first


def run_http(
    model_dir: Path,
    prompts: Prompts,
    gaps: Gaps,
    pct: Callable[[list[float], float], float],
    repeats: int,
    short_tokens: int,
    before_tokens: int,
    profile: bool = False,
) -> dict[str, list[float]]:
    """Both apps up, warmed up, then ``repeats`` interleaved runs; the medians per app of
    (p50 before, p99 before, p50 during, p99 during), in seconds. ``profile``: the P/D
    app's runs are profiled (``bench/pd_profile.py``) and the readings printed."""
    from bench.serve_defaults import serve_run

    profiled: list[tuple[RunProfile, list[list[float]], float, float, float]] = []
    with contextlib.ExitStack() as stack:
        apps = {
            name: stack.enter_context(serve_run(str(model_dir), group))
            for name, group in GROUPS.items()
        }
        profiler = None
        if profile:
            profiler = Profiler(apps["P/D"][2])
            stack.callback(profiler.close)
        for name, (url, model, *_) in apps.items():
            print(f"{name}: {url} serves {model}", flush=True)
            for seed in (98, 99):  # warm-up: first-use costs stay out of the figures
                asyncio.run(one_run(url, model, prompts, seed, short_tokens, before_tokens))

        def one(name: str, i: int) -> tuple[float, ...]:
            url, model, *_ = apps[name]
            prof = profiler if name == "P/D" else None
            others = [app[2] for other, app in apps.items() if other != name]
            with paused(others):  # the app not measured takes no CPU meanwhile
                if prof is not None:
                    prof.start()
                times, arrival, first = asyncio.run(
                    one_run(url, model, prompts, i, short_tokens, before_tokens, prof)
                )
            before, during = gaps(times, arrival, first)
            figs = (pct(before, 50), pct(before, 99), pct(during, 50), pct(during, 99))
            if prof is not None:
                profiled.append((prof.collect(), times, arrival, first, figs[0]))
            print(
                f"run {i} {name:9s} "
                + " ".join(f"{x * 1e3:7.1f}" for x in figs)
                + f"  ({len(during)} gaps during, long TTFT {(first - arrival) * 1e3:.0f} ms)",
                flush=True,
            )
            return figs

        runs = interleaved(list(apps), repeats, one)  # A, B; B, A; ...
        if profiled:
            report_profile(profiled, decode_step_times(apps["P/D"][2]))
    return {
        name: [statistics.median(r[k] for r in rows) for k in range(4)]
        for name, rows in runs.items()
    }


def report_profile(
    profiled: list[tuple[RunProfile, list[list[float]], float, float, float]],
    steps: list[tuple[float, float]],
) -> None:
    """Per P/D run: the long gaps' excess split engine / delivery; then the table."""
    print(f"\nP/D gaps during the prefill above {GAP_X:g}x the p50 before, excess over it")
    for i, (_, times, arrival, first, p50) in enumerate(profiled):
        split, engine_p50, engine_p99 = split_gaps(times, arrival, first, steps, p50)
        worst = ", ".join(f"{g * 1e3:.0f} ({e * 1e3:.0f})" for g, e in split.worst[:4])
        print(
            f"run {i}: engine step interval p50 before {engine_p50 * 1e3:.1f} ms, p99 during "
            f"{engine_p99 * 1e3:.1f} ms; {split.gaps} long gaps, excess {split.excess * 1e3:.0f}"
            f" ms = engine {split.engine * 1e3:.0f} + delivery {split.delivery * 1e3:.0f}; "
            f"longest gaps ms (engine's part): {worst}"
        )
    print_table([p for p, *_ in profiled])
