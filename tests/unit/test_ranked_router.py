"""The replica deployments' Serve request router follows the ranking that a call's typed
message carries: each ranked replica is its own tier, best first; the rest come last."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from actors.serving.messages import AbortPrompt, OpenChannel, ReplicaCall, StartPrompt
from actors.serving.router import RankedRequestRouter


def replica(rid: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def tiers(msg: object) -> list[list[str]]:
    candidates = [replica(r) for r in ("a", "b", "c")]
    pending = SimpleNamespace(args=[msg], kwargs={})
    # choose_replicas reads only its arguments: no Serve router state is needed
    chosen = asyncio.run(RankedRequestRouter.choose_replicas(None, candidates, pending))  # type: ignore[arg-type]
    return [[r.replica_id.unique_id for r in tier] for tier in chosen]


def test_each_message_kind_is_pinned_to_its_ranking():
    for msg in (
        StartPrompt(requests=[], ingress="i", ranking=("c", "a")),
        AbortPrompt(ingress="i", key="k", ranking=("c", "a")),
        OpenChannel(ingress="i", replica_id="c", ranking=("c", "a")),
        ReplicaCall(ranking=("c", "a", "c")),
    ):
        assert tiers(msg) == [["c"], ["a"], ["b"]]


def test_an_unranked_or_unknown_call_may_go_anywhere():
    assert tiers(ReplicaCall()) == [["a", "b", "c"]]
    assert tiers(ReplicaCall(ranking=("gone",))) == [["a", "b", "c"]]
    assert tiers({"ranking": ["c"]}) == [["a", "b", "c"]]  # untyped payloads carry no pin
