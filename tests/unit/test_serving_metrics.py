"""Serving metrics (actors/serving/metrics.py): replica snapshots in, Prometheus text out,
parsed back with prometheus_client's parser; the router's decisions; the Grafana dashboard
names only metrics the code defines."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.disagg.conductor import RequestRejected
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.serving.metrics import (
    PDCounters,
    ReplicaMetrics,
    ReplicaSample,
    RouterMetrics,
    metric_families,
    render,
)
from errors import OverloadedError
from policies.replica_stats import ReplicaStats
from policies.routing import RouteRequest

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def stats(running: int = 1, waiting: int = 2, kv: float = 0.25) -> ReplicaStats:
    return ReplicaStats(running, waiting, 48, 30, 40, kv, 0.5, time=0.0)


def output(rid: str, prompt: int, gen: int, cached: int = 0, reason: str | None = "length"):
    return RequestOutput(
        rid,
        list(range(prompt)),
        list(range(gen)),
        finished=True,
        finish_reason=reason,
        num_cached_tokens=cached,
        arrival_time=100.0,
        first_token_time=100.5 if gen else None,
        finish_time=100.5 + 0.1 * max(gen - 1, 0),
    )


def parse(text: str) -> dict[str, list]:
    """family name -> samples (name, labels, value)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples, name: str, **labels) -> float:
    hits = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def one_replica() -> ReplicaMetrics:
    m = ReplicaMetrics()
    # r1: 4 tokens, one per step at t = 0, 0.1, 0.3, 0.6: gaps 0.1, 0.2, 0.3
    for t in (0.0, 0.1, 0.3, 0.6):
        m.on_deltas([StreamDelta("r1", [7], "x", False)], t)
    # r2: its first delta carries 1 token, the second 2 tokens 0.2 s later: 2 gaps of 0.1
    m.on_deltas([StreamDelta("r2", [1], "a", False)], 1.0)
    m.on_deltas([StreamDelta("r2", [2, 3], "bc", False), StreamDelta("r3", [], "", True)], 1.2)
    m.on_finished(output("r1", prompt=32, gen=4, cached=16))
    m.on_finished(output("r2", prompt=20, gen=3, reason="stop"))
    m.on_finished(output("r3", prompt=8, gen=0, reason=None))  # aborted before a token
    return m


def test_replica_snapshot_renders_vllm_names_per_replica():
    m = one_replica()
    snap = pickle.loads(pickle.dumps(m.snapshot()))  # it travels to the router over Ray
    view = RouterMetrics(
        {"rep-a": ReplicaSample("default", stats(), snap)}, {("prefix_aware", "routed"): 3}
    )
    text = render(view, model_name=MODEL, http_requests={("/v1/completions", 200): 5}, pending=1)
    fams = parse(text)
    assert all(n.startswith("meridian:") for n in fams), sorted(fams)
    lab = {"model_name": MODEL, "replica": "rep-a", "group": "default"}

    ttft = fams["meridian:time_to_first_token_seconds"]
    assert value(ttft, "meridian:time_to_first_token_seconds_count", **lab) == 2  # r3: none
    assert value(ttft, "meridian:time_to_first_token_seconds_sum", **lab) == pytest.approx(1.0)
    itl = fams["meridian:inter_token_latency_seconds"]
    assert value(itl, "meridian:inter_token_latency_seconds_count", **lab) == 5
    assert value(itl, "meridian:inter_token_latency_seconds_sum", **lab) == pytest.approx(0.8)
    assert value(itl, "meridian:inter_token_latency_seconds_bucket", le="0.1", **lab) == 3
    assert value(itl, "meridian:inter_token_latency_seconds_bucket", le="+Inf", **lab) == 5
    e2e = fams["meridian:e2e_request_latency_seconds"]
    assert value(e2e, "meridian:e2e_request_latency_seconds_count", **lab) == 3
    tpot = fams["meridian:request_time_per_output_token_seconds"]
    assert value(tpot, "meridian:request_time_per_output_token_seconds_count", **lab) == 2

    success = fams["meridian:request_success"]
    assert value(success, "meridian:request_success_total", finished_reason="length") == 1
    assert value(success, "meridian:request_success_total", finished_reason="stop") == 1
    assert value(success, "meridian:request_success_total", finished_reason="abort") == 1
    assert value(fams["meridian:prompt_tokens"], "meridian:prompt_tokens_total") == 60
    assert value(fams["meridian:generation_tokens"], "meridian:generation_tokens_total") == 7
    queries = fams["meridian:prefix_cache_queries"]
    assert value(queries, "meridian:prefix_cache_queries_total", **lab) == 60
    assert value(fams["meridian:prefix_cache_hits"], "meridian:prefix_cache_hits_total") == 16

    assert value(fams["meridian:num_requests_running"], "meridian:num_requests_running") == 1
    assert value(fams["meridian:num_requests_waiting"], "meridian:num_requests_waiting") == 2
    assert value(fams["meridian:kv_cache_usage_perc"], "meridian:kv_cache_usage_perc") == 0.25
    assert value(fams["meridian:kv_cache_free_blocks"], "meridian:kv_cache_free_blocks") == 30
    queued = fams["meridian:num_queued_prefill_tokens"]
    assert value(queued, "meridian:num_queued_prefill_tokens", **lab) == 48

    decisions = fams["meridian:router_decisions"]
    assert (
        value(decisions, "meridian:router_decisions_total", policy="prefix_aware", outcome="routed")
        == 3
    )
    http = fams["meridian:http_requests"]
    assert value(http, "meridian:http_requests_total", route="/v1/completions", status="200") == 5
    assert (
        value(fams["meridian:ingress_pending_requests"], "meridian:ingress_pending_requests") == 1
    )
    assert value(fams["meridian:num_replicas"], "meridian:num_replicas") == 1
    assert "_created" not in text


def test_histograms_are_cumulative_and_end_at_count():
    m = ReplicaMetrics()
    for i, v in enumerate([0.0005, 0.003, 0.02, 0.2, 3.0, 500.0]):
        m.on_finished(
            RequestOutput(
                f"r{i}", [1], [1], True, "stop", arrival_time=0.0, first_token_time=v, finish_time=v
            )
        )
    view = RouterMetrics({"r": ReplicaSample("g", stats(), m.snapshot())})
    fams = parse(render(view, model_name=MODEL, http_requests={}, pending=0))
    buckets = [
        s for s in fams["meridian:time_to_first_token_seconds"] if s.name.endswith("_bucket")
    ]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts)
    assert buckets[-1].labels["le"] == "+Inf" and counts[-1] == 6
    assert buckets[-1].labels == {"model_name": MODEL, "replica": "r", "group": "g", "le": "+Inf"}


def test_replicas_keep_their_own_series():
    a, b = ReplicaMetrics(), ReplicaMetrics()
    a.on_finished(output("x", prompt=4, gen=2))
    for i in range(3):
        b.on_finished(output(f"y{i}", prompt=4, gen=2))
    view = RouterMetrics(
        {
            "rep-b": ReplicaSample("default", stats(running=0), b.snapshot()),
            "rep-a": ReplicaSample("default", stats(running=2), a.snapshot()),
        }
    )
    fams = parse(render(view, model_name=MODEL, http_requests={}, pending=0))
    ttft = fams["meridian:time_to_first_token_seconds"]
    name = "meridian:time_to_first_token_seconds_count"
    assert value(ttft, name, replica="rep-a") == 1
    assert value(ttft, name, replica="rep-b") == 3
    running = fams["meridian:num_requests_running"]
    assert value(running, "meridian:num_requests_running", replica="rep-a") == 2
    assert value(running, "meridian:num_requests_running", replica="rep-b") == 0
    assert value(fams["meridian:num_replicas"], "meridian:num_replicas") == 2


def test_disaggregated_counters_and_rejections():
    counters = PDCounters(
        kv_transfer_bytes=1 << 20,
        kv_transfer_layers=64,
        store_loaded_blocks=5,
        store_stored_blocks=9,
        store_replicated_blocks=2,
        prefill_restarts=1,
        decode_restarts=0,
        store_dram_hit_blocks=30,
        store_ssd_hit_blocks=4,
        store_miss_blocks=6,
    )
    m = ReplicaMetrics(lambda: counters)
    m.on_refused(RequestRejected("decode_full", 1.0))
    m.on_refused(RequestRejected("decode_full", 2.0))
    m.on_refused(RequestRejected("ttft_slo", 1.0))
    m.on_refused(OverloadedError("the queue is full"))  # not the Conductor's: not counted
    view = RouterMetrics({"pd": ReplicaSample("pd", stats(), m.snapshot())})
    fams = parse(render(view, model_name=MODEL, http_requests={}, pending=0))
    rej = fams["meridian:pd_rejections"]
    assert value(rej, "meridian:pd_rejections_total", reason="decode_full", group="pd") == 2
    assert value(rej, "meridian:pd_rejections_total", reason="ttft_slo") == 1
    assert len(rej) == 2
    bytes_ = fams["meridian:kv_transfer_bytes"]
    assert value(bytes_, "meridian:kv_transfer_bytes_total", replica="pd") == 1 << 20
    assert (
        value(fams["meridian:kv_store_stored_blocks"], "meridian:kv_store_stored_blocks_total") == 9
    )
    hits = fams["meridian:kv_store_hit_blocks"]
    assert value(hits, "meridian:kv_store_hit_blocks_total", tier="dram", replica="pd") == 30
    assert value(hits, "meridian:kv_store_hit_blocks_total", tier="ssd") == 4
    misses = fams["meridian:kv_store_miss_blocks"]
    assert value(misses, "meridian:kv_store_miss_blocks_total") == 6
    restarts = fams["meridian:pd_prefill_restarts"]
    assert value(restarts, "meridian:pd_prefill_restarts_total") == 1


def test_empty_view_renders_and_lists_every_family():
    fams = parse(render(RouterMetrics(), model_name=MODEL, http_requests={}, pending=0))
    assert value(fams["meridian:num_replicas"], "meridian:num_replicas") == 0
    assert set(fams) <= set(metric_families())


def test_router_counts_decisions_and_keeps_samples():
    from actors.serving.router import RouterDeployment

    async def run() -> RouterMetrics:
        router = RouterDeployment("prefix_aware", block_size=16)
        req = RouteRequest("q0", [1, 2], 40)
        assert await router.route(req) == []  # no replica yet
        snap = ReplicaMetrics().snapshot()
        await router.report("rep-a", "default", stats(), snap, [("stored", 1)], None, True)
        assert await router.route(RouteRequest("q1", [1, 2], 40)) == [("rep-a", "default")]
        assert await router.route(RouteRequest("q2", [3], 20)) == [("rep-a", "default")]
        return await router.metrics()

    view = asyncio.run(run())
    assert view.decisions == {("prefix_aware", "no_replica"): 1, ("prefix_aware", "routed"): 2}
    assert list(view.replicas) == ["rep-a"] and view.replicas["rep-a"].group == "default"
    text = render(view, model_name=MODEL, http_requests={}, pending=0)
    assert 'outcome="no_replica"' in text


# -- the Grafana dashboard ------------------------------------------------------------------------
def exposed_series() -> set[str]:
    names = set()
    for name, kind in metric_families().items():
        if kind == "counter":
            names.add(name + "_total")
        elif kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            names.add(name)
    return names


def dashboard_exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        if isinstance(node.get("definition"), str):
            found.append(node["definition"])
        return found + [e for v in node.values() for e in dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in dashboard_exprs(v)]
    return []


def test_grafana_dashboard_names_only_defined_metrics():
    dash = json.loads((REPO / "docs" / "grafana_dashboard.json").read_text())
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 10
    used = {n for e in exprs for n in re.findall(r"meridian:[A-Za-z0-9_:]+", e)}
    assert used, exprs
    assert used <= exposed_series(), sorted(used - exposed_series())
    for e in exprs:  # every query names a metric of ours
        assert "meridian:" in e, e
    for want in (
        "meridian:time_to_first_token_seconds_bucket",
        "meridian:inter_token_latency_seconds_bucket",
        "meridian:e2e_request_latency_seconds_bucket",
        "meridian:kv_cache_usage_perc",
        "meridian:prefix_cache_hits_total",
        "meridian:http_requests_total",
    ):
        assert want in used, want
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_snapshot_is_reused_within_min_interval():
    m = ReplicaMetrics(min_interval_s=60.0)
    first = m.snapshot()
    m.on_finished(output("x", prompt=4, gen=2))
    assert m.snapshot() is first  # younger than min_interval_s: the previous one
    fresh = ReplicaMetrics()
    fresh.on_finished(output("x", prompt=4, gen=2))
    assert fresh.snapshot() is not fresh.snapshot()  # default: always a new one
