"""Per-replica serving metrics and their Prometheus text exposition.

Replicas keep ``ReplicaMetrics`` (histograms and counters, plain data), push snapshots to
the router with their stats, and the ingress renders every replica's latest snapshot at
``/metrics``, labelled ``replica``. Invariant: a histogram's bucket counts are cumulative
and its last bucket (``+Inf``) equals its count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {"buckets": list(self.buckets), "cumulative": cumulative, "sum": self.sum}


class ReplicaMetrics:
    """Written by the engine thread only; ``snapshot`` returns plain data for the router."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.requests = {"stop": 0, "length": 0, "abort": 0}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0

    def on_finished(self, out: Any) -> None:
        """``out`` is a finished ``RequestOutput``."""
        reason = out.finish_reason or "abort"
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_prompt_tokens += out.num_cached_tokens
        self.generation_tokens += len(out.token_ids)
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            n = len(out.token_ids)
            if n > 1 and out.finish_time is not None:
                self.tpot.observe(max(0.0, (out.finish_time - out.first_token_time) / (n - 1)))

    def snapshot(self) -> dict[str, Any]:
        return {
            "ttft": self.ttft.snapshot(),
            "tpot": self.tpot.snapshot(),
            "requests": dict(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }


# -- exposition -------------------------------------------------------------------------------
_GAUGES = {
    "num_running": ("meridian_num_requests_running", "Requests running on the replica"),
    "num_waiting": ("meridian_num_requests_waiting", "Requests queued on the replica"),
    "queued_prefill_tokens": ("meridian_queued_prefill_tokens", "Prompt tokens not computed"),
    "kv_usage": ("meridian_kv_cache_usage_ratio", "Fraction of KV blocks in use"),
    "free_blocks": ("meridian_kv_free_blocks", "KV blocks free or evictable"),
    "cache_hit_ratio": ("meridian_prefix_cache_hit_ratio", "Prompt tokens served from cache"),
}
_COUNTERS = {
    "prompt_tokens": ("meridian_prompt_tokens_total", "Prompt tokens of finished requests"),
    "cached_prompt_tokens": ("meridian_cached_prompt_tokens_total", "Prompt tokens hit"),
    "generation_tokens": ("meridian_generation_tokens_total", "Tokens generated"),
}
_HISTOGRAMS = {
    "ttft": ("meridian_time_to_first_token_seconds", "Arrival to first token"),
    "tpot": ("meridian_time_per_output_token_seconds", "Mean gap between output tokens"),
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(replicas: Mapping[str, Mapping[str, Any]], ingress: Mapping[str, Any]) -> str:
    """Prometheus text format. ``replicas``: replica id -> {"stats": ..., "metrics": ...};
    ``ingress``: {"http_requests": {(route, status): n}, "pending": n}."""
    lines: list[str] = []
    for key, (name, help_) in _GAUGES.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        for rid, r in sorted(replicas.items()):
            if key in r.get("stats", {}):
                lines.append(f'{name}{{replica="{_label(rid)}"}} {float(r["stats"][key])}')
    for key, (name, help_) in _COUNTERS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
        for rid, r in sorted(replicas.items()):
            if key in r.get("metrics", {}):
                lines.append(f'{name}{{replica="{_label(rid)}"}} {r["metrics"][key]}')
    name = "meridian_requests_finished_total"
    lines += [f"# HELP {name} Finished requests by reason", f"# TYPE {name} counter"]
    for rid, r in sorted(replicas.items()):
        for reason, n in sorted(r.get("metrics", {}).get("requests", {}).items()):
            lines.append(f'{name}{{replica="{_label(rid)}",finish_reason="{reason}"}} {n}')
    for key, (name, help_) in _HISTOGRAMS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for rid, r in sorted(replicas.items()):
            h = r.get("metrics", {}).get(key)
            if not h:
                continue
            lab = f'replica="{_label(rid)}"'
            for b, c in zip([*h["buckets"], "+Inf"], h["cumulative"], strict=True):
                lines.append(f'{name}_bucket{{{lab},le="{b}"}} {c}')
            lines.append(f"{name}_sum{{{lab}}} {h['sum']}")
            lines.append(f"{name}_count{{{lab}}} {h['cumulative'][-1]}")
    name = "meridian_http_requests_total"
    lines += [f"# HELP {name} HTTP requests by route and status", f"# TYPE {name} counter"]
    for (route, status), n in sorted(ingress.get("http_requests", {}).items()):
        lines.append(f'{name}{{route="{_label(route)}",status="{status}"}} {n}')
    name = "meridian_ingress_pending_requests"
    lines += [f"# HELP {name} Requests in flight at this ingress", f"# TYPE {name} gauge"]
    lines.append(f"{name} {ingress.get('pending', 0)}")
    name = "meridian_num_replicas"
    lines += [f"# HELP {name} Replicas the router knows", f"# TYPE {name} gauge"]
    lines.append(f"{name} {len(replicas)}")
    return "\n".join(lines) + "\n"
