"""A disaggregated group's ``prefill`` / ``decode`` section (``PDLayoutConfig``) and the
checks that tie it to the group's engine section.

    prefill: {tp: 1, kv_cache_memory: 33554432,
              autoscaling: {min_replicas: 1, max_replicas: 4, target: 2048}}
    decode: {kvp: 1, storage_bytes_per_s: 1.0e8, kv_cache_memory: 100663296,
             autoscaling: {min_replicas: 1, max_replicas: 2, target: 0.8}}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from actors.engine.config import EngineConfig
from policies.pool_scaling import DECODE_POOL, PREFILL_POOL, PoolScaler, PoolScaling

# a pool's default target: queued prefill tokens per prefill replica, KV use per decode one
DEFAULT_POOL_TARGETS = {PREFILL_POOL: 2048.0, DECODE_POOL: 0.8}


class PoolAutoscalingConfig(BaseModel):
    """A prefill or decode pool scaled on its own signal (``policies.pool_scaling``) by the
    group's one Conductor: ``target`` is queued prefill tokens per replica (prefill; default
    2048) or KV use per replica in (0, 1] (decode; default 0.8). The side's ``num_prefill``
    / ``num_decode`` is the pool's starting size, within the bounds."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target: float | None = Field(None, gt=0)
    downscale_threshold: float = Field(0.5, gt=0, le=1)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)

    def scaling(self, pool: str) -> PoolScaling:
        target = self.target if self.target is not None else DEFAULT_POOL_TARGETS[pool]
        return PoolScaling(
            self.min_replicas,
            self.max_replicas,
            target,
            self.downscale_threshold,
            self.upscale_delay_s,
            self.downscale_delay_s,
        )


class PDLayoutConfig(BaseModel):
    """Each prefill (or decode) replica of a disaggregated group: tensor, sequence-pipeline
    and (decode only) KV-parallel degrees; ``kv_cache_memory``, its KV bytes per worker
    (None: the group engine's), since a prefill replica holds only the prompts it is
    prefilling and a decode replica every request in flight; and its node's emulated
    storage link (DualPath's storage NIC, ``store.transfer.links``): bytes per second its
    store reads (and a decode replica's write-back) share; None: not limited."""

    model_config = ConfigDict(extra="forbid")  # a typo in a config key is an error

    tp: int = Field(1, ge=1)
    spp: int = Field(1, ge=1)
    kvp: int = Field(1, ge=1)  # decode only: a prefill replica streams from one KV rank
    storage_bytes_per_s: float | None = Field(None, gt=0)
    kv_cache_memory: int | None = Field(None, gt=0)
    autoscaling: PoolAutoscalingConfig | None = None  # the side's pool scales (one cluster)


def check_side_kv(
    where: str, engine: EngineConfig, prefill: PDLayoutConfig | None, decode: PDLayoutConfig | None
) -> None:
    """A side's ``kv_cache_memory`` sizes its pools, so the engine must not fix every pool
    by ``num_blocks``."""
    sized = [
        name
        for name, side in (("prefill", prefill), ("decode", decode))
        if side is not None and side.kv_cache_memory is not None
    ]
    if sized and engine.num_blocks is not None:
        raise ValueError(
            f"{where}: {sized[0]}.kv_cache_memory sizes that side's KV pool, but "
            f"engine.num_blocks={engine.num_blocks} fixes every pool; remove one of them"
        )


def check_pools(
    where: str,
    num_replicas: int,
    sides: dict[str, tuple[int, PDLayoutConfig | None]],
) -> None:
    """A pool scales only in a group that is one cluster (one Serve replica, its
    Conductor), starting within its bounds with a target its signal can take."""
    for pool, (count, side) in sides.items():
        scaling = side.autoscaling if side is not None else None
        if scaling is None:
            continue
        if num_replicas != 1:
            raise ValueError(
                f"{where}: {pool}.autoscaling scales the group's one cluster, but "
                f"num_replicas={num_replicas} makes {num_replicas} islands; set num_replicas: 1"
            )
        try:
            PoolScaler(pool, scaling.scaling(pool))
        except ValueError as e:
            raise ValueError(f"{where}: {pool}.autoscaling: {e}") from None
        if not scaling.min_replicas <= count <= scaling.max_replicas:
            raise ValueError(
                f"{where}: num_{pool}={count} is the {pool} pool's starting size and must be "
                f"within {pool}.autoscaling's [{scaling.min_replicas}, {scaling.max_replicas}]"
            )
