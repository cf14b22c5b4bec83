"""What one ``PDCluster`` is made of, as one typed object (``PDClusterConfig``).

Built once at the edge (the Serve config's P/D group, ``LLM(num_prefill=...)``, a test or a
bench) from an ``EngineConfig`` that is already validated; the cluster derives each side's
replica engine config from it (``side_engine``) and never parses options again.

    PDClusterConfig(
        engine=EngineConfig(block_size=16, ...),
        prefill=PDSideConfig(count=2, tp=2),
        decode=PDSideConfig(count=1),
        store=StoreConfig(dram_bytes=...),
        conductor=ConductorOptions(ttft_slo=..., admission="early"),
    )
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.disagg.conductor import ConductorOptions
from actors.disagg.dualpath_placement import SCHEDULERS
from actors.disagg.read_paths import READ_PATHS
from actors.disagg.store_view import StoreConfig
from actors.engine.config import EngineConfig
from actors.engine.defaults import DECODE_WAIT_MAX, DECODE_WAIT_S, PIN_CORES
from policies.conductor import Conductor
from policies.dualpath import PREFILL_PATH
from policies.pool_scaling import PoolScaling
from store.transfer.links import LinkBudget


@dataclass(frozen=True)
class PDSideConfig:
    """The prefill (or decode) side: ``count`` replicas, each of ``tp`` x ``spp`` (x
    ``kvp``, decode only) workers (None: the engine config's degree). ``link_budget``: the
    replica's store reads (and a decode replica's writes) pay this emulated per-node link;
    ``record_loads``: it keeps its store-load timeline (benches and tests);
    ``kv_cache_memory``: bytes of KV per worker of each replica (None: the engine config's),
    e.g. a decode side that holds every in-flight request larger than a prefill side that
    holds only the prompts it is prefilling. ``scaling``: the side's pool grows and shrinks
    on its own signal within the given bounds (``actors.disagg.elastic_pools``; None: it
    stays at ``count``, which is then its starting size)."""

    count: int = 1
    tp: int | None = None
    spp: int | None = None
    kvp: int | None = None
    link_budget: LinkBudget | None = None
    record_loads: bool = False
    kv_cache_memory: int | None = None
    scaling: PoolScaling | None = None

    def __post_init__(self) -> None:
        s = self.scaling
        if s is not None and not s.min_replicas <= self.count <= s.max_replicas:
            raise ValueError(
                f"a scaled pool starts with count={self.count} replicas, outside its bounds "
                f"[{s.min_replicas}, {s.max_replicas}]"
            )
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.count < 1:
            raise ValueError("need at least one prefill and one decode replica")
        for name in ("tp", "spp", "kvp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class PDClusterConfig:
    """``model_dir``: a Hugging Face model folder (None: the built-in tiny model).
    ``engine``: every replica's engine config (each side's ``tp`` / ``spp`` over it).
    ``store``: KV store shards (None: no store). ``conductor``: Mooncake's Conductor by its
    options, or a ready one. ``fit_costs``: refit the Conductor's estimates from measured
    steps. ``max_prefill_attempts``: a request runs at most this often before it ends
    without text. ``pin_cores`` (default on, ``actors.engine.defaults``): on a one-node
    cluster of two or more cores, bind prefill replicas to one half of the cores and decode
    replicas to the other, as many torch threads as cores each; False: the OS places them.
    ``read_path`` (with a store): where a stored prefix is read, ``"prefill"``,
    ``"decode"`` or ``"dual"`` (the shorter read queue).
    ``scheduler``: ``"mooncake"`` (the Conductor's TTFT/TBT choice) or ``"dualpath"``
    (DualPath's rules); ``dualpath_thresholds``: its (alpha, beta) in tokens (None: from
    the fitted cost model). ``node_resources``: a region's node resource; every actor of
    the cluster runs only on nodes that carry it, and its workers reserve it too.
    ``decode_wait_s`` / ``decode_wait_max``: a request that finds no decode room waits
    (FIFO) at most this long, at most this many at once, before a 429
    (``policies.decode_wait``; defaults in ``actors.engine.defaults``; 0 s: refuse at once).
    ``pool``: the name of a shared pool (``actors.disagg.pool_actors``): replicas and store
    shards are detached actors that outlive this cluster's process, and a cluster started
    under the same name attaches to the live ones (None: private actors, gone with it)."""

    model_dir: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PDSideConfig = field(default_factory=PDSideConfig)
    decode: PDSideConfig = field(default_factory=PDSideConfig)
    store: StoreConfig | None = None
    conductor: ConductorOptions | Conductor = field(default_factory=ConductorOptions)
    fit_costs: bool = True
    max_prefill_attempts: int = 3
    pin_cores: bool = PIN_CORES
    read_path: str = PREFILL_PATH
    scheduler: str = "mooncake"
    dualpath_thresholds: tuple[int, int] | None = None
    node_resources: dict[str, float] = field(default_factory=dict)
    decode_wait_s: float = DECODE_WAIT_S
    decode_wait_max: int = DECODE_WAIT_MAX
    pool: str | None = None

    def __post_init__(self) -> None:
        if self.engine.cpu_cores is not None:
            raise ValueError(
                "cpu_cores pins a colocated replica's engine thread; prefill and decode "
                "replicas do not take it yet: leave it unset for a disaggregated deployment"
            )
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}"
            )
        if self.read_path not in READ_PATHS:
            raise ValueError(
                f"read_path must be one of {', '.join(READ_PATHS)}, got {self.read_path!r}"
            )
        if self.read_path != PREFILL_PATH and self.store is None:
            raise ValueError(
                f"read_path={self.read_path!r} reads a KV store: give store=StoreConfig(...)"
            )
        if self.decode_wait_s < 0 or self.decode_wait_max < 0:
            raise ValueError("decode_wait_s and decode_wait_max must be >= 0")
        if self.max_prefill_attempts < 1:
            raise ValueError("max_prefill_attempts must be at least 1")
        sized = [s.kv_cache_memory for s in (self.prefill, self.decode) if s.kv_cache_memory]
        if sized and self.engine.num_blocks is not None:
            raise ValueError(
                "a side's kv_cache_memory sizes its pool, but engine.num_blocks fixes every "
                "pool: give one of them"
            )
        decode = self.side_engine(self.decode)
        decode_store = self.store is not None and (
            self.store.write_back or self.read_path != PREFILL_PATH
        )
        if decode_store and decode.tp * decode.spp * decode.kvp > 1:
            raise ValueError(
                "write-back and decode-side store reads use a decode replica's cache in its "
                "own process: with them, decode replicas run tp = spp = kvp = 1 (set "
                f"read_path={PREFILL_PATH!r} and no write_back, or a single-worker decode side)"
            )

    def model_folder(self) -> str:
        """The model folder served (the built-in tiny model's when ``model_dir`` is None)."""
        from models import tiny_model_dir

        return self.model_dir or str(tiny_model_dir("dense"))

    def kv_block_bytes(self, on_gpu: bool) -> int:
        """Bytes of one KV block of the model under ``engine``: every layer, K and V."""
        from kernels.kv_cache import kv_cache_bytes_per_block
        from models.config import read_model_config

        model = read_model_config(Path(self.model_folder()))
        return kv_cache_bytes_per_block(
            model.num_hidden_layers,
            self.engine.block_size,
            model.num_key_value_heads,
            model.head_dim,
            self.engine.torch_dtype(on_gpu),
        )

    def side_engine(self, side: PDSideConfig) -> EngineConfig:
        """The engine config of each replica of ``side``: its layout and KV size over
        ``engine``, its workers also reserving ``node_resources``."""
        changes: dict[str, Any] = {}
        if side.tp is not None:
            changes["tp"] = side.tp
        if side.spp is not None:
            changes["spp"] = side.spp
        if side.kvp is not None:
            changes["kvp"] = side.kvp
        if side.kv_cache_memory is not None:
            changes["kv_cache_memory"] = side.kv_cache_memory
        if self.node_resources:
            pinned = self.engine.worker_resources or {}
            changes["worker_resources"] = {**pinned, **self.node_resources}
        return dataclasses.replace(self.engine, **changes) if changes else self.engine
