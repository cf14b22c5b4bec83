"""Typed messages from an ingress to the replica deployments (``replica.py``).

Each carries ``ranking``: the replica ids the global router ranked for it, best first,
which ``RankedRequestRouter`` follows (empty: any replica). A call meant for one replica
ranks only that one.

    ingress -> replica:  StartPrompt    (start: the replica answers Accepted or Refused)
                         OpenChannel    (events: the ingress's one event stream there)
                         AbortPrompt    (abort_prompt: its client left)
                         ReplicaCall    (blocks_report, and any call that needs only a pin)
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.direct_return import ReturnAddress
from policies.request import Request


@dataclass(frozen=True, kw_only=True)
class ReplicaCall:
    ranking: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StartPrompt(ReplicaCall):
    """One prompt's choices, as the ingress built them; their events go to the channel of
    ``ingress`` under the prompt's key (its first choice's request id). ``reply``: where
    the ingress listens for events sent straight from where they are made (a
    disaggregated group's decode replicas, ``actors.engine.direct_return``)."""

    requests: list[Request]
    ingress: str
    reply: ReturnAddress | None = None

    @property
    def key(self) -> str:
        return self.requests[0].request_id


@dataclass(frozen=True, kw_only=True)
class AbortPrompt(ReplicaCall):
    ingress: str
    key: str


@dataclass(frozen=True, kw_only=True)
class OpenChannel(ReplicaCall):
    """``replica_id``: the replica meant; another one that Serve routed it to answers
    ``WRONG_REPLICA``."""

    ingress: str
    replica_id: str
