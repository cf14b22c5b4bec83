"""What ``bench/serve.py`` measures and prints: one request's timings (``Sample``), one
side's run (``Run``, its metrics as ``vllm bench serve`` defines them), and the result
block with a column per side (medians over the repeats).

Goodput, as ``vllm bench serve --goodput`` counts it: requests per second of run time that
met both SLOs (TTFT, and TPOT where the request has more than one output token). A
multi-turn run (MT-bench) also reports its second turns' TTFT on their own: those turns
carry the first turn and its answer as a prefix, which a prefix cache can skip."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from bench.interleave import medians
from sim.metrics import percentile


@dataclass
class Sample:
    """One request: seconds from send to first token and to the end, gaps between chunks."""

    ttft: float
    e2e: float
    itls: list[float]
    output_tokens: int
    turn: int = 1  # the turn of its conversation (1 for single-turn workloads)
    prompt_tokens: int = 0  # as the server's usage counted them (chat template included)
    cached_tokens: int | None = None  # of those, served from cache; None: usage had no details

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets(self, ttft_slo: float, tpot_slo: float) -> bool:
        tpot = self.tpot
        return self.ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo)


class TokenClock:
    """Arrival times of one stream's chunks that carried tokens: the first, then the gaps."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.itls: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.itls.append(now - self.last)
        self.last = now


@dataclass
class Run:
    side: str
    concurrency: int
    duration: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    input_tokens: int = 0
    engine_itl: float = float("nan")  # the engine's own mean gap between tokens (its metric)
    client_lag: float = float("nan")  # seconds the bench's loop woke late, at most (client_wait)
    client_runqueue: float = float("nan")  # seconds its loop thread waited for a CPU
    client_cpu: float = float("nan")  # seconds its loop thread ran on a CPU
    cached_tokens: float = float("nan")  # prompt tokens the server served from its cache
    ttft_slo: float = float("inf")  # seconds
    tpot_slo: float = float("inf")  # seconds

    @property
    def throughput(self) -> float:
        return len(self.samples) / self.duration

    @property
    def goodput(self) -> float:
        good = sum(s.meets(self.ttft_slo, self.tpot_slo) for s in self.samples)
        return good / self.duration

    def metrics(self) -> dict[str, float]:
        ttft = [s.ttft * 1e3 for s in self.samples]
        e2e = [s.e2e * 1e3 for s in self.samples]
        tpot = [t * 1e3 for s in self.samples if (t := s.tpot) is not None]
        itl = [x * 1e3 for s in self.samples for x in s.itls]
        out_tokens = sum(s.output_tokens for s in self.samples)
        m = {
            "requests": len(self.samples),
            "duration": self.duration,
            "input_tokens": self.input_tokens,
            "output_tokens": out_tokens,
            "req_s": self.throughput,
            "goodput": self.goodput,
            "out_tok_s": out_tokens / self.duration,
            "tot_tok_s": (out_tokens + self.input_tokens) / self.duration,
            "engine_itl": self.engine_itl * 1e3,
        }
        if not math.isnan(self.cached_tokens):
            m["cached_tokens"] = self.cached_tokens
        if not math.isnan(self.client_lag):  # measured (chat runs)
            m["client_lag"] = self.client_lag * 1e3
            m["client_runqueue"] = self.client_runqueue
            m["client_cpu"] = self.client_cpu
        for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
            m[f"mean_{name}"] = statistics.fmean(xs) if xs else float("nan")
            m[f"median_{name}"] = statistics.median(xs) if xs else float("nan")
            m[f"p99_{name}"] = percentile(xs, 99)
        second = [s.ttft * 1e3 for s in self.samples if s.turn == 2]
        if second:
            first = [s.ttft * 1e3 for s in self.samples if s.turn == 1]
            m["median_ttft_turn1"] = statistics.median(first) if first else float("nan")
            m["p99_ttft_turn1"] = percentile(first, 99)
            m["median_ttft_turn2"] = statistics.median(second)
            m["p99_ttft_turn2"] = percentile(second, 99)
        return m


ROWS = [
    ("Successful requests:", "requests", "{:.0f}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "input_tokens", "{:.0f}"),
    ("Total generated tokens:", "output_tokens", "{:.0f}"),
    ("Prompt tokens from cache:", "cached_tokens", "{:.0f}"),
    ("Request throughput (req/s):", "req_s", "{:.2f}"),
    ("Request goodput (req/s):", "goodput", "{:.2f}"),
    ("Output token throughput (tok/s):", "out_tok_s", "{:.2f}"),
    ("Total Token throughput (tok/s):", "tot_tok_s", "{:.2f}"),
    ("Time to First Token", None, None),
    ("Mean TTFT (ms):", "mean_ttft", "{:.2f}"),
    ("Median TTFT (ms):", "median_ttft", "{:.2f}"),
    ("P99 TTFT (ms):", "p99_ttft", "{:.2f}"),
    ("Time per Output Token (excl. 1st token)", None, None),
    ("Mean TPOT (ms):", "mean_tpot", "{:.2f}"),
    ("Median TPOT (ms):", "median_tpot", "{:.2f}"),
    ("P99 TPOT (ms):", "p99_tpot", "{:.2f}"),
    ("Inter-token Latency", None, None),
    ("Mean ITL (ms):", "mean_itl", "{:.2f}"),
    ("Median ITL (ms):", "median_itl", "{:.2f}"),
    ("P99 ITL (ms):", "p99_itl", "{:.2f}"),
    ("End-to-end Latency", None, None),
    ("Mean E2EL (ms):", "mean_e2el", "{:.2f}"),
    ("Median E2EL (ms):", "median_e2el", "{:.2f}"),
    ("P99 E2EL (ms):", "p99_e2el", "{:.2f}"),
    ("Multi-turn (MT-bench)", None, None),
    ("Median first-turn TTFT (ms):", "median_ttft_turn1", "{:.2f}"),
    ("P99 first-turn TTFT (ms):", "p99_ttft_turn1", "{:.2f}"),
    ("Median second-turn TTFT (ms):", "median_ttft_turn2", "{:.2f}"),
    ("P99 second-turn TTFT (ms):", "p99_ttft_turn2", "{:.2f}"),
    ("Engine side (the replica's metrics)", None, None),
    ("Mean engine ITL (ms):", "engine_itl", "{:.2f}"),
    ("The client's own wait (bench/client_wait.py)", None, None),
    ("Max event-loop lag (ms):", "client_lag", "{:.0f}"),
    ("Run-queue wait (s):", "client_runqueue", "{:.2f}"),
    ("CPU time (s):", "client_cpu", "{:.2f}"),
]


WIDTH = 64


def median_metrics(runs: list[Run]) -> dict[str, float]:
    return medians([r.metrics() for r in runs])


def print_table(title: str, columns: dict[str, list[Run]]) -> None:
    """One ``vllm bench serve`` result block with a column per side (medians of runs)."""
    names = list(columns)
    meds = {name: median_metrics(runs) for name, runs in columns.items()}
    col = 14
    label_w = WIDTH - col * len(names)
    print(f" {title} ".center(WIDTH, "="))
    print(" " * label_w + "".join(f"{n:>{col}}" for n in names))
    measured = set().union(*meds.values())
    header: str | None = None  # printed before the first of its rows that some side measured
    for label, key, fmt in ROWS:
        if key is None:
            header = label
            continue
        if key not in measured:
            continue
        if header is not None:
            print(header.center(WIDTH, "-"))
            header = None
        assert fmt is not None
        cells = "".join(f"{fmt.format(meds[n].get(key, float('nan'))):>{col}}" for n in names)
        print(f"{label:<{label_w}}{cells}")
    for n in names:
        tps = sorted(r.throughput for r in columns[n])
        runs = ", ".join(f"{t:.2f}" for t in tps)
        print(f"{n} req/s over {len(tps)} run(s): {runs}")
    print("=" * WIDTH)
