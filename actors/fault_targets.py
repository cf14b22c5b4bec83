"""The live actors of a running app by kind, as a fault injector finds and kills them, or
drains a pool replica (``bench/soak.py`` and the reliability tests).

An actor's kind comes from its class name in the GCS actor table (no dashboard needed):
the Serve deployments (ingress, router, colocated or Conductor replica), engine workers,
prefill and decode replicas, KV store shards. A named actor is looked up in its own
namespace, read from Ray's list of named actors: Serve's actors live in ``serve``, a shared
pool's prefill and decode replicas and store shards in ``pool_actors.POOL_NAMESPACE``, a
P/D cluster's replicas outside a pool (``pd-<id>-<unique>``) in the namespace of the driver
that started them. Nothing assumes one namespace for all.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray

# kind -> how to recognise its actors by class name
KIND_CLASS: dict[str, Callable[[str], bool]] = {
    "ingress": lambda c: c.endswith(":Ingress"),
    "router": lambda c: c.endswith(":Router"),
    "replica": lambda c: ":Replica-" in c,
    "worker": lambda c: c == "Worker",
    "prefill": lambda c: c == "PrefillReplica",
    "decode": lambda c: c == "DecodeReplica",
    "store": lambda c: c == "KVStoreShard",
}
SERVE_KINDS = ("ingress", "router", "replica")  # Serve's own deployments
POOL_KINDS = ("prefill", "decode")  # a P/D cluster's replicas: they can be asked to drain


@dataclass(frozen=True)
class ActorInfo:
    kind: str
    class_name: str
    name: str  # '' for an unnamed actor
    namespace: str  # '' for an unnamed actor
    pid: int
    actor_id: str  # hex


def kind_of(class_name: str) -> str | None:
    for kind, match in KIND_CLASS.items():
        if match(class_name):
            return kind
    return None


def live_actors(kinds: Iterable[str] | None = None) -> list[ActorInfo]:
    """Every live actor of a known kind (of ``kinds`` when given), each with the namespace
    its name lives in."""
    from ray._private import state

    wanted = set(KIND_CLASS if kinds is None else kinds)
    unknown = wanted - set(KIND_CLASS)
    if unknown:
        raise ValueError(f"unknown actor kinds {sorted(unknown)}; known: {sorted(KIND_CLASS)}")
    namespaces: dict[str, list[str]] = defaultdict(list)
    for a in ray.util.list_named_actors(all_namespaces=True):
        namespaces[a["name"]].append(a["namespace"])
    out = []
    for actor_id, a in state.actors(actor_state_name="ALIVE").items():
        cls = a.get("ActorClassName", "")
        kind = kind_of(cls)
        if kind is None or kind not in wanted:
            continue
        name = a.get("Name", "")
        out.append(
            ActorInfo(
                kind=kind,
                class_name=cls,
                name=name,
                namespace=_namespace(name, actor_id, namespaces.get(name, [])),
                pid=int(a.get("Pid") or 0),
                actor_id=actor_id,
            )
        )
    return out


def _namespace(name: str, actor_id: str, candidates: list[str]) -> str:
    """The namespace of the named actor ``actor_id``: the one namespace holding ``name``,
    or, when several do, the one whose actor under ``name`` is this actor."""
    if not name or not candidates:
        return ""
    if len(candidates) == 1:
        return candidates[0]
    for namespace in candidates:
        try:
            if ray.get_actor(name, namespace=namespace)._actor_id.hex() == actor_id:
                return namespace
        except ValueError:  # gone since it was listed
            continue
    return ""


def handle(actor: ActorInfo) -> Any:
    """A handle to the named ``actor``, looked up in its own namespace."""
    if not actor.name:
        raise ValueError(f"{actor.kind} actor {actor.actor_id} is unnamed: no handle by name")
    if not actor.namespace:
        raise ValueError(f"{actor.kind} actor {actor.name!r}: its namespace is unknown")
    return ray.get_actor(actor.name, namespace=actor.namespace)


def kill(actor: ActorInfo) -> None:
    """A crash of ``actor``: ``ray.kill`` of a Serve deployment's actor (so Serve sees it die
    at once and starts another), SIGKILL of any other actor's process (its owner, a
    Conductor or a replica, finds out as it would after a real crash); ``ray.kill`` by
    handle when the process is not known."""
    if actor.kind in SERVE_KINDS or not actor.pid:
        ray.kill(handle(actor), no_restart=True)
    else:
        os.kill(actor.pid, signal.SIGKILL)


def drain(actor: ActorInfo) -> None:
    """Ask a prefill or decode pool replica to leave its pool (``LoopedReplica.drain``): its
    Conductor stops placing work on it once another replica of the pool takes work, lets
    what it holds finish and then retires it; a pool of fixed size starts a replacement at
    once. Returns once the replica took the request (it leaves later)."""
    if actor.kind not in POOL_KINDS:
        raise ValueError(f"only pool replicas ({', '.join(POOL_KINDS)}) drain, not {actor.kind}")
    ray.get(handle(actor).drain.remote())


def is_alive(actor: ActorInfo) -> bool:
    return any(a.actor_id == actor.actor_id for a in live_actors([actor.kind]))
