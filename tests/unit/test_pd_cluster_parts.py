"""The plain parts of a P/D cluster, without Ray: its request table (attempts by key, the
retry queue) and its one config object (checks before anything starts, each side's engine
config derived from the one built at the edge)."""

from __future__ import annotations

import pytest

from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.disagg.pd_request import PDRequest
from actors.disagg.request_table import RequestTable
from actors.disagg.store_view import StoreConfig
from actors.engine.config import EngineConfig
from policies.request import Request, SamplingParams


def request(rid: str) -> PDRequest:
    return PDRequest(Request(rid, [1, 2, 3], SamplingParams(max_tokens=5), 7, 4, []))


def test_an_attempt_is_found_by_its_key_until_it_is_unbound():
    table = RequestTable()
    a, b = request("a"), request("b")
    table.add(a)
    table.add(b)
    with pytest.raises(ValueError, match="already in use"):
        table.add(request("a"))
    a.start_attempt("a#1", "p0", "d0")
    table.bind("a#1", a)
    b.start_attempt("b#1", "p1", "d0")
    table.bind("b#1", b)
    assert table.attempt("a#1") is a and table.attempt("a#2") is None
    assert table.in_prefill_on("p0") == [a] and table.bound_to_decode("d0") == [a, b]
    assert table.in_prefill_counts() == {"p0": 1, "p1": 1}
    assert table.num_waiting() == 2 and table.has_unfinished()
    assert table.unbind("a#1") is a and table.attempt("a#1") is None
    assert table.unbind("a#1") is None


def test_retries_come_back_in_order_and_a_turned_away_one_waits_behind():
    table = RequestTable()
    reqs = [request(r) for r in "abc"]
    for r in reqs:
        table.add(r)
        table.retry_later(r)
    table.cancel_retry("b")
    assert table.num_waiting() == 2
    taken = []
    for r in table.take_retries():
        taken.append(r.request_id)
        table.retry_later(r)  # turned away again
    assert taken == ["a", "c"]
    reqs[0].end()  # an ended request is not placed again
    table.remove("a")
    assert [r.request_id for r in table.take_retries()] == ["c"]
    assert list(table.take_retries()) == []


def test_each_side_gets_its_layout_over_the_one_engine_config():
    engine = EngineConfig(block_size=8, worker_resources={"gpu-a": 1.0})
    config = PDClusterConfig(
        engine=engine,
        prefill=PDSideConfig(count=2, spp=2),
        decode=PDSideConfig(tp=2),
        node_resources={"region-eu": 0.01},
    )
    p, d = config.side_engine(config.prefill), config.side_engine(config.decode)
    assert (p.tp, p.spp, d.tp, d.spp) == (1, 2, 2, 1)
    assert p.block_size == d.block_size == 8
    assert p.worker_resources == {"gpu-a": 1.0, "region-eu": 0.01}
    plain = PDClusterConfig(engine=engine)
    assert plain.side_engine(plain.prefill) is engine  # nothing to change: the same object


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: PDClusterConfig(engine=EngineConfig(cpu_cores=[0])), "leave it unset"),
        (lambda: PDSideConfig(count=0), "at least one prefill and one decode"),
        (lambda: PDSideConfig(tp=0), "tp must be at least 1"),
        (lambda: PDClusterConfig(scheduler="fifo"), "scheduler must be one of"),
        (lambda: PDClusterConfig(read_path="disk"), "read_path must be one of"),
        (lambda: PDClusterConfig(read_path="decode"), "give store=StoreConfig"),
        (lambda: PDClusterConfig(max_prefill_attempts=0), "max_prefill_attempts"),
        (
            lambda: PDClusterConfig(store=StoreConfig(write_back=True), decode=PDSideConfig(kvp=2)),
            "decode replicas run tp = spp = kvp = 1",
        ),
        (
            lambda: PDClusterConfig(
                store=StoreConfig(), read_path="dual", decode=PDSideConfig(tp=2)
            ),
            "decode replicas run tp = spp = kvp = 1",
        ),
    ],
)
def test_a_bad_cluster_config_is_refused_before_anything_starts(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_a_decode_read_path_with_a_store_is_accepted():
    config = PDClusterConfig(store=StoreConfig(), read_path="decode", scheduler="dualpath")
    assert config.read_path == "decode"
    # a multi-worker decode side with a store it neither reads nor writes
    PDClusterConfig(store=StoreConfig(), decode=PDSideConfig(kvp=2, tp=2))
