"""A disaggregated replica group's ``PDClusterConfig``: what one Serve replica of the group
starts (``actors.disagg.engine.PDEngine``), from the group's validated sections.

The group's ``engine`` section is every prefill and decode replica's ``EngineConfig``
(each side's ``tp`` / ``spp`` / ``kvp`` from its ``prefill`` / ``decode`` section); the store's SSD
files go to ``<store.ssd_dir>/<replica_id>`` so replicas on one node never share a folder;
the store section's ``read_path`` and ``write_back`` and the conductor section's
``scheduler`` (DualPath), ``decode_wait_s`` and ``decode_wait_max`` pass through; each
side's ``storage_bytes_per_s`` is its replicas' emulated storage link
(``PDSideConfig.link_budget``) and its ``kv_cache_memory`` its replicas' KV size over the
group engine's; ``node_resources`` (a region's node resource) pins every
actor of the cluster to the nodes that carry it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.disagg.conductor import ConductorOptions
from actors.disagg.store_view import StoreConfig
from actors.serving.config import (
    ConductorSectionConfig,
    PDLayoutConfig,
    ReplicaGroupConfig,
    StoreSectionConfig,
)
from policies.dualpath import PREFILL_PATH
from policies.pool_scaling import DECODE_POOL, PREFILL_POOL
from store.transfer.links import LinkBudget


def shared_pool_name(app: str, group: ReplicaGroupConfig, model: str | None = None) -> str | None:
    """The name of ``group``'s shared pool in Serve application ``app``: a disaggregated
    group of one Serve replica (its Conductor) is one cluster whose replicas and shards
    outlive the Conductor's process (``actors.disagg.pool_actors``); with ``num_replicas``
    above 1 each Serve replica owns a private island (None). The name ends with a digest
    of the model and the group's config, so a Conductor never attaches to replicas built
    from another config (a redeploy that changes it starts a new pool)."""
    if not group.disaggregated or group.num_replicas != 1:
        return None
    digest = hashlib.sha256(f"{model}\n{group.model_dump_json()}".encode()).hexdigest()[:12]
    return f"{app}/{group.name}/{digest}"


def pd_cluster_config(
    model: str | None,
    group: ReplicaGroupConfig,
    replica_id: str,
    node_resources: dict[str, float] | None = None,
    pool: str | None = None,
) -> PDClusterConfig:
    """The cluster of Serve replica ``replica_id`` of the disaggregated ``group``;
    ``pool``: the group's shared pool (``shared_pool_name``), whose SSD files go to
    ``<store.ssd_dir>/<group>`` (they outlive one Conductor)."""
    if group.num_prefill is None or group.num_decode is None:
        raise ValueError(f"group {group.name!r} is not disaggregated")
    conductor = group.conductor or ConductorSectionConfig()
    return PDClusterConfig(
        model_dir=model,
        engine=group.engine,
        prefill=_side(PREFILL_POOL, group.num_prefill, group.prefill),
        decode=_side(DECODE_POOL, group.num_decode, group.decode),
        store=_store(group.store, group.name if pool is not None else replica_id),
        conductor=ConductorOptions(
            admission=conductor.admission,
            ttft_slo=conductor.ttft_slo,
            tbt_slo=conductor.tbt_slo,
            replication_threshold=conductor.replication_threshold,
        ),
        fit_costs=conductor.fit_costs,
        read_path=group.store.read_path if group.store is not None else PREFILL_PATH,
        scheduler=conductor.scheduler,
        decode_wait_s=conductor.decode_wait_s,
        decode_wait_max=conductor.decode_wait_max,
        node_resources=dict(node_resources or {}),
        pin_cores=group.pin_cores,
        pool=pool,
    )


def _side(pool: str, count: int, layout: PDLayoutConfig | None) -> PDSideConfig:
    if layout is None:
        return PDSideConfig(count)
    rate = layout.storage_bytes_per_s
    budget = LinkBudget(storage_bps=rate) if rate is not None else None
    scaling = layout.autoscaling
    return PDSideConfig(
        count,
        tp=layout.tp,
        spp=layout.spp,
        kvp=layout.kvp,
        link_budget=budget,
        kv_cache_memory=layout.kv_cache_memory,
        scaling=scaling.scaling(pool) if scaling is not None else None,
    )


def _store(section: StoreSectionConfig | None, folder: str) -> StoreConfig | None:
    if section is None:
        return None
    ssd_dir = str(Path(section.ssd_dir) / folder) if section.ssd_dir else None
    return StoreConfig(
        section.dram_bytes,
        section.ssd_bytes,
        ssd_dir,
        section.num_shards,
        section.write_back,
        section.tenant_retained_share,
        section.placement_for(disaggregated=True),
    )
