"""The KV store shards of a colocated replica group: app-wide, shared by all its replicas.

A colocated group with a ``store`` section (``actors.serving.config``) keeps ``num_shards``
shard actors (``actors.kvstore.shard``) on every Ray node alive when its replicas start, as
detached actors of the pool ``<app>/<group>`` (``actors.disagg.pool_actors``). A shard's
name is fixed by its id, ``<tag>-<node>-<k>`` (the node's id, its index there, and ``tag``:
a digest of the model and the KV block geometry, so shards of another model deployed under
the same names are never read), and every replica asks for it with Ray's
``get_if_exists`` (``pool_actors.shared_actor_options``): replicas that start at once get
the same actor, and a replica that replaces a dead one attaches to the shards its peers
use, with every block they hold.

A shard that died is started again, empty, under its name (``revive``) by a replica that
found it dead, at most every ``REVIVE_S`` and only while its node is alive; until then its
blocks read as misses. The shards outlive the replicas (a redeploy of the same app and
model finds them); ``stop(pool)`` kills them.

    shards = AppShards(spec)                 # starts or attaches every shard
    shards.handles -> {shard id: handle}; shards.node_of(shard id)
    shards.revive([shard id, ...]) -> {shard id: new handle}
    stop(pool) -> int
"""

from __future__ import annotations

import contextlib
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from actors.disagg import pool_actors
from actors.kvstore.shard import kv_store_shard_actor
from actors.ray_nodes import alive_nodes, pinned
from placement.nodes import Node

REVIVE_S = 5.0  # a dead shard is started again at most this often


@dataclass(frozen=True)
class ShardSpec:
    """What every replica of the group agrees on: the pool's name, the block size in
    bytes (every layer's K and V of one block), the store section's sizes, and ``tag``
    (``shard_tag``)."""

    pool: str
    block_bytes: int
    tag: str
    dram_bytes: int = 64 << 20
    ssd_bytes: int = 0
    ssd_dir: str | None = None  # each shard's SSD files go to <ssd_dir>/<pool>/<shard>-<n>
    num_shards: int = 1  # per node
    tenant_retained_share: float = 1.0  # sessions: one tenant's share of a shard (retention)


def shard_tag(*parts: object) -> str:
    """A short digest of what makes stored KV reusable (the model, dtype, block geometry)."""
    return f"{zlib.crc32('|'.join(map(str, parts)).encode()):08x}"


def shard_ids(nodes: list[Node], per_node: int, tag: str) -> dict[str, Node]:
    """``per_node`` shard ids on every node, by node id then index (any replica computes
    the same ids for the same nodes)."""
    return {
        f"{tag}-{node.node_id[:12]}-{k}": node
        for node in sorted(nodes, key=lambda n: n.node_id)
        for k in range(per_node)
    }


class AppShards:
    def __init__(self, spec: ShardSpec) -> None:
        if spec.ssd_bytes > 0 and spec.ssd_dir is None:
            raise ValueError("ssd_bytes > 0 needs ssd_dir")
        self.spec = spec
        self._cls = kv_store_shard_actor()
        nodes = alive_nodes()
        self._multi_node = len(nodes) > 1
        self._nodes = shard_ids(nodes, spec.num_shards, spec.tag)
        self._revived: dict[str, float] = {}  # shard id -> when it was last started again
        self.handles: dict[str, Any] = {sid: self._ensure(sid) for sid in self._nodes}

    def node_of(self, shard_id: str) -> str:
        return self._nodes[shard_id].node_id

    def _ensure(self, sid: str) -> Any:
        """The live actor named for ``sid``, started here (pinned to its node) if none is."""
        spec, node = self.spec, self._nodes[sid]
        ssd_dir = None
        if spec.ssd_bytes > 0 and spec.ssd_dir is not None:
            # a folder per actor started: a shard never reads a dead one's files
            folder = spec.pool.replace("/", "-")
            ssd_dir = str(Path(spec.ssd_dir) / folder / f"{sid}-{uuid.uuid4().hex[:8]}")
        options = pool_actors.shared_actor_options(spec.pool, sid)
        return pinned(self._cls, node.node_id, **options).remote(
            sid,
            spec.block_bytes,
            spec.dram_bytes,
            spec.ssd_bytes,
            ssd_dir,
            tcp_host=node.address if self._multi_node else "127.0.0.1",
            # NIXL's owner agent keeps a core busy (store.transfer.nixl_backend): only
            # where peers can sit on other nodes; same-node peers map the segment
            serve_nixl=None if self._multi_node else False,
            tenant_retained_share=spec.tenant_retained_share,
        )

    def revive(self, dead: list[str]) -> dict[str, Any]:
        """Start the shards of ``dead`` again under their names (the first replica to ask
        starts each, the others attach to it), those last started ``REVIVE_S`` ago or
        more and whose node is alive; returns their new handles."""
        now = time.monotonic()
        due = [s for s in dead if s in self._nodes and now - self._revived.get(s, 0) >= REVIVE_S]
        if not due:
            return {}
        alive = {n.node_id for n in alive_nodes()}
        out = {}
        for sid in due:
            self._revived[sid] = now
            if self._nodes[sid].node_id in alive:
                out[sid] = self.handles[sid] = self._ensure(sid)
        return out


def stop(pool: str) -> int:
    """Kill every shard of ``pool`` (the group is gone for good); returns how many."""
    found = pool_actors.find(pool)
    for handle in found.values():
        with contextlib.suppress(*pool_actors.GONE, GetTimeoutError):
            ray.get(handle.close.remote(), timeout=pool_actors.PING_TIMEOUT_S)
        with contextlib.suppress(*pool_actors.GONE):
            ray.kill(handle)
    return len(found)
