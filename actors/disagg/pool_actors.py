"""The actors of a shared pool: named, detached, and found again by the next Conductor.

A disaggregated group served as one cluster (``PDClusterConfig.pool``) starts its prefill
and decode replicas and its store shards as detached actors named
``<pool>/<id>/<unique>`` in ``POOL_NAMESPACE``. They outlive the process that started
them, so when the Conductor's process dies the replicas keep their loaded weights and
prefix caches and the shards keep every stored block; the Conductor started in its place
finds them by name (``find``) and attaches (``PDCluster``: each replica is reset, its
state read back from its report, the store's directory from the shards' event logs).

A colocated group's store shards (``actors.serving.store_shards``) are pool actors too, each
named by its id alone (``shared_actor_options``): every replica of the group starts or
attaches to the same actor with Ray's ``get_if_exists``.

Invariants: at most one live actor per id is kept (``find`` kills extra ones, e.g. a
replacement started just before its Conductor died); an actor that does not answer
``ping`` within ``PING_TIMEOUT_S`` counts as gone. The pool's actors are killed only by
``PDCluster.shutdown`` (the group stopping), never by a Conductor's death.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

POOL_NAMESPACE = "meridian-pools"
PING_TIMEOUT_S = 10.0
GONE = (RayActorError, ActorUnavailableError)  # an actor that died (or is dying)


def pool_actor_options(pool: str, actor_id: str) -> dict[str, Any]:
    """Ray actor options of pool actor ``actor_id`` (``p0``, ``d1``, ``s0``...)."""
    return {
        "name": f"{pool}/{actor_id}/{uuid.uuid4().hex[:12]}",
        "namespace": POOL_NAMESPACE,
        "lifetime": "detached",
    }


def shared_actor_options(pool: str, actor_id: str) -> dict[str, Any]:
    """Ray actor options of pool actor ``actor_id`` that several processes may start at
    once (a colocated group's store shards): the name is fixed by the id (``<pool>/<id>``,
    which ``find`` reads as well) and Ray's ``get_if_exists`` hands every caller the one
    live actor under it, so racing starters never make two."""
    return {
        "name": f"{pool}/{actor_id}",
        "namespace": POOL_NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
    }


def find(pool: str) -> dict[str, Any]:
    """The live actors of ``pool`` by id (one each; extras are killed)."""
    prefix = f"{pool}/"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == POOL_NAMESPACE and a["name"].startswith(prefix)
    ]
    found: dict[str, Any] = {}
    for name in sorted(names):
        actor_id = name[len(prefix) :].split("/", 1)[0]
        try:
            handle = ray.get_actor(name, namespace=POOL_NAMESPACE)
            ray.get(handle.ping.remote(), timeout=PING_TIMEOUT_S)
        except (ValueError, GetTimeoutError, *GONE):
            continue  # gone since it was listed, or hung
        if actor_id in found:
            with contextlib.suppress(*GONE):
                ray.kill(handle)
            continue
        found[actor_id] = handle
    return found
