"""A disaggregated group's ``prefill`` / ``decode`` section (``PDLayoutConfig``) and the
checks that tie it to the group's engine section.

    prefill: {tp: 1, kv_cache_memory: 33554432}
    decode: {kvp: 1, storage_bytes_per_s: 1.0e8, kv_cache_memory: 100663296}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from actors.engine.config import EngineConfig


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
