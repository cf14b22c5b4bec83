"""``/metrics`` says which transfer backend carried KV on each path of a P/D cluster: the
prefill replicas report the backend each of their peers was reached over, and
``meridian:pd_kv_transfer_links{path,backend}`` counts the pairs."""

from __future__ import annotations

from actors.disagg.engine import transfer_links
from actors.disagg.messages import PDCounters, PrefillStats
from actors.serving.metrics import ReplicaMetrics


def stats(backends: dict[str, str], loads: dict[str, str]) -> PrefillStats:
    return PrefillStats(0, 0, 0, 0, 0, 0, backends, load_backends=loads)


def test_transfer_links_count_each_replica_peer_pair_by_path_and_backend():
    reports = [
        stats({"d0": "nixl"}, {"s0": "shm", "s1": "nixl"}),
        stats({"d0": "shm"}, {"s1": "shm"}),
    ]
    assert transfer_links(reports) == (
        ("prefill->decode", "nixl", 1),
        ("prefill->decode", "shm", 1),
        ("store->prefill", "nixl", 1),
        ("store->prefill", "shm", 2),
    )


def test_the_links_are_a_labelled_gauge_on_metrics():
    links = (("prefill->decode", "tcp", 2),)
    metrics = ReplicaMetrics(lambda: PDCounters(0, 0, 0, 0, 0, 0, 0, transfer_links=links))
    (family,) = [f for f in metrics.snapshot().families if f.name.endswith("transfer_links")]
    assert family.name == "meridian:pd_kv_transfer_links"
    (sample,) = family.samples
    assert sample.labels == {"path": "prefill->decode", "backend": "tcp"} and sample.value == 2
