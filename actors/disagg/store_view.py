"""The KV store of a disaggregated deployment, as its Conductor uses it.

``num_shards`` store shards on every node (``actors.kvstore.shard``), the client holding
the cluster-wide block -> shards map, and what the Conductor asks of them:

- ``home_shard(node, rank)``: the shard a prefill replica on ``node`` writes to and counts
  as its own (the node's prefill replicas, by ``rank``, spread over its shards; any live
  shard when the node has none);
- ``copy_blocks``: put blocks the Conductor wants on an instance into its home shard, shard
  to shard (``change_replica``) where a shard holds them, else through ``export`` (the
  holder replica writes them out of its own cache);
- ``tier_counts``: blocks the shards served from DRAM and from SSD, and misses, summed;
  ``retention_counts``: their sessions' retained blocks, retention hits, expired retentions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.disagg import pool_actors
from actors.kvstore.shard import KVStoreClient, kv_store_shard_actor
from actors.ray_nodes import pinned
from placement.nodes import NodePlacement
from policies.shard_choice import check_placement

RETENTION_KEYS = ("retained_blocks", "retention_hit_blocks", "expired_retentions")
DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)  # an actor that is gone


@dataclass
class StoreConfig:
    """KV store shards of the deployment: ``num_shards`` on every node of the cluster."""

    dram_bytes: int = 64 << 20
    ssd_bytes: int = 0
    ssd_dir: str | None = None  # a folder per shard is made under it
    num_shards: int = 1
    # decode replicas write each block back as it fills (DualPath), so a later turn of a
    # conversation hits its own previous answer; needs decode replicas with tp=spp=1
    write_back: bool = False
    # sessions: the share of a shard's blocks one tenant's retained blocks may hold
    # (``store.retention``; past it the tenant's oldest retained blocks lose retention)
    tenant_retained_share: float = 1.0
    # which shard a prefix is written to: "local" (the writer's node; measured faster for
    # P/D, docs/benchmarks.md) or "key" (its first block's owner): ``policies.shard_choice``
    placement: str = "local"

    def __post_init__(self) -> None:
        check_placement(self.placement)


class PDStore:
    def __init__(
        self,
        cfg: StoreConfig,
        block_bytes: int,
        placement: NodePlacement,
        pool: str | None = None,
    ) -> None:
        """``pool``: the shards are a shared pool's (``actors.disagg.pool_actors``): live
        ones a previous Conductor started are attached, and the directory is rebuilt from
        their event logs."""
        if cfg.ssd_bytes > 0 and cfg.ssd_dir is None:
            raise ValueError("StoreConfig.ssd_bytes > 0 needs ssd_dir")
        self.cfg, self.block_bytes, self.placement = cfg, block_bytes, placement
        self.pool = pool
        self._shard_cls = kv_store_shard_actor()
        self.shards: dict[str, Any] = {}
        self.num_restarts = 0
        found = pool_actors.find(pool) if pool is not None else {}
        for sid in placement.place_shards(cfg.num_shards):
            self.shards[sid] = found[sid] if sid in found else self._start(sid)
        self.client = KVStoreClient("pd-conductor")
        for sid, handle in self.shards.items():
            self.client.add_shard(sid, handle)
        if found:
            self.client.refresh()  # the blocks the attached shards hold
        self._stats: dict[str, dict[str, int]] = {}  # shard -> its latest stats()
        self._stats_calls: dict[str, Any] = {}  # shard -> its stats() call in flight
        self._stats_asked = 0.0

    def _start(self, sid: str) -> Any:
        cfg = self.cfg
        ssd_dir = None
        if cfg.ssd_bytes > 0 and cfg.ssd_dir is not None:
            suffix = f"-r{self.num_restarts}" if self.num_restarts else ""  # never a dead one's
            ssd_dir = str(Path(cfg.ssd_dir) / f"shard-{sid[1:]}{suffix}")
        names = pool_actors.pool_actor_options(self.pool, sid) if self.pool is not None else {}
        return pinned(
            self._shard_cls, self.placement.node_id(sid), soft=self.num_restarts > 0, **names
        ).remote(
            sid,
            self.block_bytes,
            cfg.dram_bytes,
            cfg.ssd_bytes,
            ssd_dir,
            tcp_host=self.placement.tcp_host(sid),
            tenant_retained_share=cfg.tenant_retained_share,
            # NIXL's owner agent keeps a core busy (store.transfer.nixl_backend): only
            # where peers can sit on other nodes; same-node peers map the segment
            serve_nixl=None if len(self.placement.nodes) > 1 else False,
        )

    def restart(self, shard_id: str) -> Any:
        """Replace a dead shard with an empty one under the same id (its blocks are gone:
        whoever needs them recomputes); returns the new handle."""
        self.client.mark_dead(shard_id)
        with contextlib.suppress(*DEAD):
            ray.kill(self.shards[shard_id])
        self.num_restarts += 1
        self.shards[shard_id] = handle = self._start(shard_id)
        self.client.add_shard(shard_id, handle)
        return handle

    def live(self) -> dict[str, Any]:
        """Handles of the shards not known dead."""
        return {s: h for s, h in self.shards.items() if s in self.client.handles}

    def home_shard(self, node_id: str, rank: int) -> str | None:
        endpoints = self.client.endpoints
        if not endpoints:
            return None
        shards = sorted(s for s, ep in endpoints.items() if ep.node_id == node_id)
        shards = shards or sorted(endpoints)
        return shards[rank % len(shards)]

    def blocks_of(self, shard_id: str | None) -> set[int]:
        return set(self.client.directory.blocks_of(shard_id)) if shard_id is not None else set()

    def all_blocks(self) -> set[int]:
        held: set[int] = set()
        for sid in self.client.directory.shards:
            held |= self.client.directory.blocks_of(sid)
        return held

    def tier_counts(self, every_s: float = 1.0) -> dict[str, int]:
        """``dram_hit_blocks``, ``ssd_hit_blocks`` and ``miss_blocks`` summed over the
        shards' latest stats. Never blocks: it asks each shard at most every ``every_s``
        and reads the replies that are in; a dead shard keeps its last counts."""
        for sid, ref in list(self._stats_calls.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self._stats_calls[sid]
                with contextlib.suppress(*DEAD):
                    self._stats[sid] = ray.get(ref)
        now = time.monotonic()
        if now - self._stats_asked >= every_s:
            self._stats_asked = now
            for sid, handle in self.live().items():
                self._stats_calls.setdefault(sid, handle.stats.remote())
        keys = ("dram_hit_blocks", "ssd_hit_blocks", "miss_blocks")
        return {k: sum(st.get(k, 0) for st in self._stats.values()) for k in keys}

    def retention_counts(self) -> dict[str, int]:
        """``RETENTION_KEYS`` summed over the shards' stats ``tier_counts`` last read."""
        return {k: sum(st.get(k, 0) for st in self._stats.values()) for k in RETENTION_KEYS}

    def refresh(self) -> list[str]:
        """Apply shard events to the map; returns shards found dead."""
        return self.client.refresh()

    def copy_blocks(
        self,
        hashes: list[int],
        dst: str,
        src_home: str | None,
        export: Callable[[list[int]], int],
    ) -> int:
        """Make ``dst`` hold ``hashes``: shard to shard from a holder (``src_home`` first),
        ``export(rest)`` for blocks no shard holds. Returns blocks copied; best effort (a
        block not copied is recomputed by whoever needs it)."""
        directory = self.client.directory
        by_source: dict[str, list[int]] = {}
        from_cache: list[int] = []
        for h in hashes:
            holders = directory.holders(h)
            if dst in holders:
                continue
            if not holders:
                from_cache.append(h)
            else:
                src = src_home if src_home in holders else min(holders)
                by_source.setdefault(src, []).append(h)
        copied = 0
        for src, run in by_source.items():
            copied += len(self.client.change_replica(run, src, dst))
        if from_cache:
            copied += export(from_cache)
            self.client.refresh()
        return copied

    def close(self) -> None:
        for handle in self.shards.values():
            try:
                ray.get(handle.close.remote())
            except DEAD:
                pass
            ray.kill(handle)
        self.client.close()
