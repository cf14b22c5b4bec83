"""A P/D cluster's pools kept at their size (``actors.disagg.elastic_pools``), over a
stand-in for the ``ReplicaSet`` (the views the Conductor reads, starts that join when a
test says so): a replica asked to leave is replaced at once in a fixed pool, keeps taking
work until another replica of its pool does, then drains and is retired once idle."""

from __future__ import annotations

from typing import Any

from actors.disagg.cluster_config import PDSideConfig
from actors.disagg.elastic_pools import ElasticPools
from actors.disagg.pd_request import PDRequest
from actors.disagg.request_table import RequestTable
from policies.conductor import DecodeInstance, PrefillInstance
from policies.pool_scaling import PoolScaling
from policies.request import Request, SamplingParams


class FakeReplicas:
    """What ``ElasticPools`` reads and calls of a ``ReplicaSet``; a started replica joins
    when the test calls ``join``."""

    def __init__(self, prefills: int, decodes: int) -> None:
        self.prefill_views = {f"p{i}": PrefillInstance(f"p{i}") for i in range(prefills)}
        self.decode_views = {
            f"d{j}": DecodeInstance(f"d{j}", total_blocks=10) for j in range(decodes)
        }
        self.starting: dict[str, Any] = {}
        self.draining: set[str] = set()
        self.retired: list[str] = []
        self._joined: list[str] = []

    def accepting(self, rid: str) -> bool:
        return rid not in self.draining

    def begin_start(self, kind: str) -> str:
        taken = {*self.prefill_views, *self.decode_views, *self.starting}
        rid = next(f"{kind[0]}{i}" for i in range(100) if f"{kind[0]}{i}" not in taken)
        self.starting[rid] = None
        return rid

    def join(self) -> None:
        self._joined = list(self.starting)

    def poll_starting(self) -> list[str]:
        joined, self._joined = self._joined, []
        for rid in joined:
            del self.starting[rid]
            if rid[0] == "p":
                self.prefill_views[rid] = PrefillInstance(rid)
            else:
                self.decode_views[rid] = DecodeInstance(rid, total_blocks=10)
        return joined

    def retire(self, rid: str) -> None:
        self.prefill_views.pop(rid, None)
        self.decode_views.pop(rid, None)
        self.draining.discard(rid)
        self.retired.append(rid)


def pools(prefills: int, decodes: int, **prefill: Any) -> tuple[ElasticPools, FakeReplicas]:
    replicas = FakeReplicas(prefills, decodes)
    elastic = ElasticPools(
        replicas,  # type: ignore[arg-type]  # the stand-in has what ElasticPools uses
        RequestTable(),
        PDSideConfig(prefills, **prefill),
        PDSideConfig(decodes),
    )
    return elastic, replicas


def actions(elastic: ElasticPools) -> list[tuple[str, str]]:
    return [(e.action, e.replica_id) for e in elastic.events]


def bind_decode(table: RequestTable, rid: str, decode_id: str) -> PDRequest:
    req = PDRequest(Request(rid, [1, 2, 3], SamplingParams(max_tokens=5), 7, 4, []))
    table.add(req)
    req.start_attempt(f"{rid}#1", "p0", decode_id)
    table.bind(f"{rid}#1", req)
    req.in_prefill = False
    return req


def test_a_fixed_pool_keeps_its_size_when_a_replica_leaves_with_another_beside_it():
    elastic, r = pools(2, 1)
    elastic.step(0.0)
    assert actions(elastic) == []  # at its size: nothing moves
    elastic.leave("p1", 1.0)
    elastic.leave("p1", 1.5)  # asked twice: once
    elastic.step(2.0)
    # p0 takes work: p1 drains at once and a replacement starts
    assert actions(elastic) == [("leave", "p1"), ("grow", "p2"), ("drain", "p1")]
    assert elastic.sizes() == {"prefill": 2, "decode": 1}  # p0 and the starting p2
    r.join()
    elastic.step(3.0)  # p1 was idle: retired at the next look
    assert actions(elastic)[3:] == [("retire", "p1")]
    assert sorted(r.prefill_views) == ["p0", "p2"] and r.retired == ["p1"]


def test_the_last_replica_of_a_pool_takes_work_until_its_replacement_joins():
    elastic, r = pools(1, 1)
    req = bind_decode(elastic.table, "a", "d0")
    elastic.leave("d0", 0.0)
    elastic.step(1.0)
    assert actions(elastic) == [("leave", "d0"), ("grow", "d1")]
    assert r.accepting("d0")  # nothing else takes decode work yet
    elastic.step(2.0)
    assert actions(elastic)[-1] == ("grow", "d1")  # one replacement, not one per step
    r.join()
    elastic.step(3.0)
    assert actions(elastic)[2:] == [("drain", "d0")]  # d1 takes work now; d0 holds "a"
    assert not r.accepting("d0") and r.retired == []
    elastic.table.unbind(req.key or "")
    req.end()  # it finished on d0
    elastic.step(4.0)
    assert actions(elastic)[3:] == [("retire", "d0")] and sorted(r.decode_views) == ["d1"]
    assert elastic.sizes() == {"prefill": 1, "decode": 1}


def test_a_scaled_pool_lets_its_scaler_decide_whether_a_leaving_replica_is_replaced():
    quiet = PoolScaling(1, 3, target=100.0, upscale_delay_s=0.0, downscale_delay_s=3600.0)
    elastic, r = pools(2, 1, scaling=quiet)
    elastic.leave("p0", 0.0)
    elastic.step(0.0)
    # no load: one replica is enough, so none starts; p1 takes work, p0 drains
    assert actions(elastic) == [("leave", "p0"), ("drain", "p0")]
    assert elastic.sizes()["prefill"] == 1
    elastic.leave("p1", 1.0)
    elastic.step(1.0)
    # p0 retired; p1 is the last: its scaler's minimum brings a replacement, and p1
    # takes work until it joins
    assert actions(elastic)[2:] == [("leave", "p1"), ("retire", "p0"), ("grow", "p0")]
    assert r.accepting("p1")
