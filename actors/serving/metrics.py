"""Serving metrics, with ``prometheus_client``: what a replica measures, and the Prometheus
exposition at the ingress's ``/metrics``.

Names and labels follow vLLM's (``vllm:`` -> ``meridian:``; label ``model_name``), plus our
own (router decisions, HTTP requests, P/D transfers and rejections, store traffic).

- A replica's engine thread writes ``ReplicaMetrics`` (prometheus_client histograms and
  counters in a private registry). ``snapshot()`` collects them into a
  ``MetricsSnapshot`` (plain ``Metric`` families), which the replica pushes to the router
  with its ``ReplicaStats``; the router keeps each replica's latest as a ``ReplicaSample``.
- The ingress calls ``render``: every replica's families, relabelled ``model_name``,
  ``replica`` and ``group``, its stats as gauges, the router's decisions and the ingress's
  own HTTP counters, in the Prometheus text format (``generate_latest``).

``metric_families()`` lists every family ``render`` can emit (the Grafana dashboard's test
checks its expressions against it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.disagg.conductor import RequestRejected
from actors.disagg.messages import PDCounters
from actors.engine.token_gaps import TokenGapClock
from policies.replica_stats import ReplicaStats

PREFIX = "meridian:"

# vLLM's buckets, the ITL's extended down to 1 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


# (family name without the prefix, help) of PDCounters' fields, as counters
_PD_FAMILIES = {
    "kv_transfer_bytes": ("kv_transfer_bytes", "KV bytes streamed from prefill to decode"),
    "kv_transfer_layers": ("kv_transfer_layers", "Layer KV transfers from prefill to decode"),
    "store_loaded_blocks": ("kv_store_loaded_blocks", "Blocks prefill loaded from the KV store"),
    "store_stored_blocks": ("kv_store_stored_blocks", "Blocks prefill stored into the KV store"),
    "store_replicated_blocks": ("kv_store_replicated_blocks", "Blocks copied between shards"),
    "prefill_restarts": ("pd_prefill_restarts", "Prefill replicas restarted after a failure"),
    "decode_restarts": ("pd_decode_restarts", "Decode replicas restarted after a failure"),
    "relayed_tokens": (
        "pd_conductor_relayed_tokens",
        "Decoded tokens that went through the Conductor's process (not straight to an ingress)",
    ),
    "store_miss_blocks": ("kv_store_miss_blocks", "Blocks asked of the KV store it did not hold"),
    "store_retention_hit_blocks": (
        "kv_store_retention_hit_blocks",
        "Blocks the KV store served while a session's retention kept them",
    ),
    "store_expired_retentions": (
        "kv_store_expired_retentions",
        "Retained KV store blocks whose retention reached its deadline",
    ),
    "decode_waits": ("pd_decode_waits", "Requests placed after waiting for decode room"),
    "decode_wait_seconds": ("pd_decode_wait_seconds", "Seconds requests waited for decode room"),
}
# PDCounters' gauges: (family name without the prefix, help)
_PD_GAUGES = {
    "store_retained_blocks": (
        "kv_store_retained_blocks",
        "KV store blocks kept ahead of LRU eviction by a session's retention",
    ),
}
# a disaggregated cluster's pools: replicas per pool, and what a scaled pool's load needs
_POOL_SIZE = ("pd_pool_replicas", "Replicas of each prefill/decode pool, starting ones counted")
_POOL_NEED = (
    "pd_pool_scaling_need",
    "Replicas a scaled pool's load needs at its target, labelled by the signal it scales on",
)
_TRANSFER_LINKS = (
    "pd_kv_transfer_links",
    "Replica-peer pairs that moved KV, by path and the transfer backend that carried it",
)
# PDCounters' per-tier fields, as one counter labelled ``tier``
_TIER_FAMILY = ("kv_store_hit_blocks", "Blocks the KV store served, by the tier they were in")
_TIER_FIELDS = {"dram": "store_dram_hit_blocks", "ssd": "store_ssd_hit_blocks"}


@dataclass(frozen=True)
class MetricsSnapshot:
    """What a replica pushes with its stats: prometheus_client families, without labels
    naming the replica (the exposition adds them) and without ``_created`` samples."""

    families: tuple[Metric, ...] = ()


@dataclass(frozen=True)
class ReplicaSample:
    """The router's latest view of one replica, as the exposition reads it."""

    group: str
    stats: ReplicaStats
    metrics: MetricsSnapshot


@dataclass(frozen=True)
class RouterMetrics:
    """What the router gives ``/metrics``: each live replica's latest sample, and its
    decisions by (policy, outcome) since it started."""

    replicas: dict[str, ReplicaSample] = field(default_factory=dict)
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)


class ReplicaMetrics:
    """Written by the engine thread only (``snapshot`` too). ``pd_counters``: a
    disaggregated engine's counters (``PDEngine.pd_counters``), read at each snapshot.
    ``min_interval_s``: ``snapshot`` returns the previous one if it is younger than that
    (a snapshot costs ~0.2 ms; the engine loop asks at every publish, the router needs one
    per report)."""

    def __init__(
        self, pd_counters: Callable[[], PDCounters] | None = None, min_interval_s: float = 0.0
    ) -> None:
        self._pd_counters = pd_counters
        self._min_interval_s = min_interval_s
        self._last: tuple[float, MetricsSnapshot] | None = None
        r = self._registry = CollectorRegistry(auto_describe=False)
        p = PREFIX
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Histogram of time to first token in seconds (arrival to first token)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (gaps between output tokens)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds (arrival to finish)",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            p + "request_time_per_output_token_seconds",
            "Histogram of a request's mean time per output token after the first, in seconds",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            p + "request_success",
            "Count of finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Number of prefill tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Number of generation tokens processed", registry=r
        )
        self.cache_queries = Counter(
            p + "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            registry=r,
        )
        self.cache_hits = Counter(
            p + "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            registry=r,
        )
        self.pd_rejections = Counter(
            p + "pd_rejections",
            "Requests the Conductor of a disaggregated replica rejected (429), by reason",
            ["reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(reason)  # present at 0 from the start
        self._token_clock = TokenGapClock()

    def on_tokens(self, request_id: str, num_tokens: int, now: float) -> None:
        """``num_tokens`` new tokens of one request reached the loop at ``now`` (monotonic);
        their gaps as ``TokenGapClock`` shares them."""
        self.on_gaps(self._token_clock.gaps(request_id, num_tokens, now))

    def on_gaps(self, gaps: Iterable[float]) -> None:
        """Gaps between tokens measured elsewhere (a decode replica's ``TokenGaps``)."""
        for gap in gaps:
            self.itl.observe(gap)

    def on_deltas(self, deltas: Iterable[Any], now: float) -> None:
        """One step's ``StreamDelta``s, all arrived at ``now``."""
        for d in deltas:
            self.on_tokens(d.request_id, len(d.token_ids), now)

    def on_finished(self, out: Any) -> None:
        """``out`` is a finished (or aborted) ``RequestOutput``."""
        self._token_clock.forget(out.request_id)
        self.success.labels(out.finish_reason or "abort").inc()
        prompt = len(out.prompt_token_ids)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(len(out.token_ids))
        self.cache_queries.inc(prompt)
        self.cache_hits.inc(out.num_cached_tokens)
        if out.finish_time is not None:
            self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            n = len(out.token_ids)
            if n > 1 and out.finish_time is not None:
                self.tpot.observe(max(0.0, (out.finish_time - out.first_token_time) / (n - 1)))

    def on_refused(self, error: Exception) -> None:
        """The engine refused a request (``add_request`` raised)."""
        if isinstance(error, RequestRejected):
            self.pd_rejections.labels(error.reason).inc()

    def snapshot(self) -> MetricsSnapshot:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self._min_interval_s:
            return self._last[1]
        families = [_without_created(m) for m in self._registry.collect()]
        if self._pd_counters is not None:
            c = self._pd_counters()
            for attr, (name, help_) in _PD_FAMILIES.items():
                fam = CounterMetricFamily(PREFIX + name, help_)
                fam.add_metric([], getattr(c, attr))
                families.append(fam)
            tiers = CounterMetricFamily(PREFIX + _TIER_FAMILY[0], _TIER_FAMILY[1], labels=["tier"])
            for tier, attr in _TIER_FIELDS.items():
                tiers.add_metric([tier], getattr(c, attr))
            families.append(tiers)
            for attr, (name, help_) in _PD_GAUGES.items():
                gauge = GaugeMetricFamily(PREFIX + name, help_)
                gauge.add_metric([], getattr(c, attr))
                families.append(gauge)
            sizes = GaugeMetricFamily(PREFIX + _POOL_SIZE[0], _POOL_SIZE[1], labels=["pool"])
            for pool, n in c.pool_replicas:
                sizes.add_metric([pool], n)
            needs = GaugeMetricFamily(
                PREFIX + _POOL_NEED[0], _POOL_NEED[1], labels=["pool", "signal"]
            )
            for pool, signal, need in c.pool_needs:
                needs.add_metric([pool, signal], need)
            links = GaugeMetricFamily(
                PREFIX + _TRANSFER_LINKS[0], _TRANSFER_LINKS[1], labels=["path", "backend"]
            )
            for path, backend, n in c.transfer_links:
                links.add_metric([path, backend], n)
            families += [sizes, needs, links]
        snap = MetricsSnapshot(tuple(families))
        self._last = (now, snap)
        return snap


def _without_created(m: Metric) -> Metric:
    out = Metric(m.name, m.documentation, m.type, m.unit)
    out.samples = [s for s in m.samples if not s.name.endswith("_created")]
    return out


# -- exposition (the ingress) -------------------------------------------------------------------
# stats field -> (gauge name without the prefix, help)
_STAT_GAUGES = {
    "num_running": ("num_requests_running", "Number of requests in model execution batches"),
    "num_waiting": ("num_requests_waiting", "Number of requests waiting to be processed"),
    "kv_usage": ("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage"),
    "queued_prefill_tokens": ("num_queued_prefill_tokens", "Prompt tokens not yet computed"),
    "free_blocks": ("kv_cache_free_blocks", "KV blocks free or evictable"),
    "total_blocks": ("kv_cache_total_blocks", "KV blocks in all"),
}
_REPLICA_LABELS = ("model_name", "replica", "group")


def render(
    router: RouterMetrics,
    *,
    model_name: str,
    http_requests: Mapping[tuple[str, int], int],
    pending: int,
) -> str:
    """The Prometheus text exposition of the router's view and the ingress's counters."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Exposition(router, model_name, http_requests, pending))
    return generate_latest(registry).decode()


class _Exposition:
    """A custom collector: a ``render`` call's data as metric families."""

    def __init__(
        self,
        router: RouterMetrics,
        model_name: str,
        http_requests: Mapping[tuple[str, int], int],
        pending: int,
    ) -> None:
        self.router = router
        self.model_name = model_name
        self.http_requests = http_requests
        self.pending = pending

    def collect(self) -> Iterator[Metric]:
        replicas = sorted(self.router.replicas.items())
        for attr, (name, help_) in _STAT_GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, help_, labels=_REPLICA_LABELS)
            for rid, r in replicas:
                g.add_metric([self.model_name, rid, r.group], float(getattr(r.stats, attr)))
            yield g
        labelled = [
            ({"model_name": self.model_name, "replica": rid, "group": r.group}, r.metrics)
            for rid, r in replicas
        ]
        yield from _merge(labelled)
        d = CounterMetricFamily(
            PREFIX + "router_decisions",
            "Routing decisions of the global router, by policy and outcome",
            labels=("model_name", "policy", "outcome"),
        )
        for (policy, outcome), n in sorted(self.router.decisions.items()):
            d.add_metric([self.model_name, policy, outcome], n)
        yield d
        h = CounterMetricFamily(
            PREFIX + "http_requests",
            "HTTP requests answered by this ingress replica, by route and status",
            labels=("model_name", "route", "status"),
        )
        for (route, status), n in sorted(self.http_requests.items()):
            h.add_metric([self.model_name, route, str(status)], n)
        yield h
        g = GaugeMetricFamily(
            PREFIX + "ingress_pending_requests",
            "Requests in flight at this ingress replica",
            labels=("model_name",),
        )
        g.add_metric([self.model_name], self.pending)
        yield g
        g = GaugeMetricFamily(
            PREFIX + "num_replicas", "Replicas the router knows", labels=("model_name",)
        )
        g.add_metric([self.model_name], len(replicas))
        yield g


def _merge(sources: Iterable[tuple[dict[str, str], MetricsSnapshot]]) -> list[Metric]:
    """One family per name over every replica's snapshot, each sample given the replica's
    labels."""
    merged: dict[str, Metric] = {}
    for labels, snap in sources:
        for m in snap.families:
            fam = merged.get(m.name)
            if fam is None:
                fam = merged[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
            for s in m.samples:
                fam.add_sample(s.name, {**labels, **s.labels}, s.value)
    return list(merged.values())


def metric_families() -> dict[str, str]:
    """Every family ``render`` can emit: name -> type ("gauge", "counter", "histogram")."""
    probe = ReplicaMetrics(lambda: PDCounters(0, 0, 0, 0, 0, 0, 0))
    own = _Exposition(RouterMetrics(), "", {}, 0).collect()
    return {m.name: m.type for m in [*own, *probe.snapshot().families]}
