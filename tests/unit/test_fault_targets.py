"""``actors.fault_targets`` tells each kind of actor by the class name Ray records for it:
the classes the runtime makes remote and the names Serve gives its deployments' actors;
only pool replicas can be asked to drain."""

from __future__ import annotations

import pytest

from actors.disagg.decode import DecodeReplica
from actors.disagg.prefill import PrefillReplica
from actors.engine.worker import Worker
from actors.fault_targets import KIND_CLASS, POOL_KINDS, ActorInfo, drain, kind_of
from actors.kvstore.shard import KVStoreShard


def test_each_kind_matches_the_class_name_of_its_actors():
    seen = {
        PrefillReplica.__name__: "prefill",
        DecodeReplica.__name__: "decode",
        Worker.__name__: "worker",
        KVStoreShard.__name__: "store",
        "ServeReplica:meridian:Replica-pd": "replica",
        "ServeReplica:meridian:Router": "router",
        "ServeReplica:meridian:Ingress": "ingress",
    }
    assert {name: kind_of(name) for name in seen} == seen
    assert set(seen.values()) == set(KIND_CLASS)


def test_serve_and_ray_internals_are_no_kind():
    for name in ("ServeController", "ProxyActor", "ServeReplica:meridian:Ingress-eu", "Conductor"):
        assert kind_of(name) is None, name


def test_only_pool_replicas_drain():
    for cls in (PrefillReplica, DecodeReplica):
        assert callable(cls.drain) and kind_of(cls.__name__) in POOL_KINDS
    worker = ActorInfo("worker", "Worker", "", "", 1, "ab")
    with pytest.raises(ValueError, match="only pool replicas"):
        drain(worker)
