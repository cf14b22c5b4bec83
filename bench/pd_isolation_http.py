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
between then and the long prompt's first token. The apps take turns (A, B, A, B, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx

Prompts = Callable[[int], tuple[list[list[int]], list[int]]]
Gaps = Callable[[list[list[float]], float, float], tuple[list[float], list[float]]]

GROUPS = {"colocated": "{name: main}", "P/D": "{name: pd, num_prefill: 1, num_decode: 1}"}


async def stream_times(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, out: list[float]
) -> None:
    """Appends the arrival time of each chunk that carries tokens to ``out``."""
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
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            choices = chunk.get("choices") or ()
            n = sum(len(c.get("token_ids") or ()) for c in choices)
            out.extend([time.monotonic()] * n)


TIMEOUT_S = 300.0  # one run's limit: a stream that stalls is an error, not a hang


def waited(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"no {what} within {TIMEOUT_S:.0f} s")


async def one_run(
    url: str, model: str, prompts: Prompts, seed: int, short_tokens: int, before_tokens: int
) -> tuple[list[list[float]], float, float]:
    """(each short request's token times, the long prompt's send time, its first token)."""
    short, long = prompts(seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        times: list[list[float]] = [[] for _ in short]
        tasks = [
            asyncio.create_task(stream_times(client, model, p, short_tokens, t))
            for p, t in zip(short, times, strict=True)
        ]
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while min(len(t) for t in times) < before_tokens:
                for t, ts in zip(tasks, times, strict=True):
                    if t.done():
                        t.result()  # raises what ended a stream early
                        raise RuntimeError(f"a short request ended after {len(ts)} tokens")
                waited(deadline, "the short requests' first tokens")
                await asyncio.sleep(0.002)
            long_times: list[float] = []
            arrival = time.monotonic()
            long_task = asyncio.create_task(stream_times(client, model, long, 2, long_times))
            while not long_times:
                if long_task.done():
                    long_task.result()
                    raise RuntimeError("the long prompt ended with no token")
                waited(deadline, "the long prompt's first token")
                await asyncio.sleep(0.002)
            first = long_times[0]
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await t
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await long_task
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
) -> dict[str, list[float]]:
    """Both apps up, warmed up, then ``repeats`` interleaved runs; the medians per app of
    (p50 before, p99 before, p50 during, p99 during), in seconds."""
    from serve_defaults import serve_run

    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in GROUPS}
    with contextlib.ExitStack() as stack:
        apps = {
            name: stack.enter_context(serve_run(str(model_dir), group))
            for name, group in GROUPS.items()
        }
        for name, (url, model) in apps.items():
            print(f"{name}: {url} serves {model}", flush=True)
            for seed in (98, 99):  # warm-up: first-use costs stay out of the figures
                asyncio.run(one_run(url, model, prompts, seed, short_tokens, before_tokens))
        for i in range(repeats):
            order = list(apps.items()) if i % 2 == 0 else list(apps.items())[::-1]
            for name, (url, model) in order:
                times, arrival, first = asyncio.run(
                    one_run(url, model, prompts, i, short_tokens, before_tokens)
                )
                before, during = gaps(times, arrival, first)
                figs = (pct(before, 0.5), pct(before, 0.99), pct(during, 0.5), pct(during, 0.99))
                runs[name].append(figs)
                print(
                    f"run {i} {name:9s} "
                    + " ".join(f"{x * 1e3:7.1f}" for x in figs)
                    + f"  ({len(during)} gaps during, long TTFT {(first - arrival) * 1e3:.0f} ms)",
                    flush=True,
                )
    return {
        name: [statistics.median(r[k] for r in rows) for k in range(4)]
        for name, rows in runs.items()
    }
