"""Wiring a replica controller: from a model folder and an ``EngineConfig`` to the parts a
``ReplicaController`` runs with (its tokenizer, KV manager, scheduler and executor).

``build_parts`` decides, in order: the device and dtype; the model's context length; the
KV blocks per rank (enough for every running request at full context, within the memory
budget, unless the config names a count); one KV manager (``KVCacheManager`` on one rank,
``ShardedKVManager`` with Medha's KVP balancer over ``kvp`` ranks); the scheduler with its
ordering and packer (Medha's deadlines and ``BatchPacker``, DualPath's
``AttentionQuotaPacker``, both sized by a ``RuntimePredictor``); the workers' spec and the
executor (in process for one worker, MoE attention/expert workers, or worker actors on Ray).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.engine.collectives import Layout
from actors.engine.config import EngineConfig
from actors.engine.executor import Executor, LocalExecutor
from actors.engine.heap_freeze import freeze_startup_heap
from actors.engine.kv_cache import KVCache
from actors.engine.worker import WorkerSpec
from actors.engine.worker_hooks import HooksFactory, WorkerHooks
from kernels.kv_cache import kv_cache_bytes_per_block
from models import load_tokenizer, tiny_model_dir
from models.config import ModelConfig, read_model_config
from models.sharding import kv_heads_per_rank
from models.tokenizer import Tokenizer
from placement.runtime_predictor import RuntimePredictor, TailStepTime
from policies.batch_packer import BatchPacker, Packer
from policies.chunking import FixedChunk
from policies.dualpath import AttentionQuotaPacker
from policies.kvp_balancer import choose_kvp_rank
from policies.ordering import Ordering
from policies.scheduler import Scheduler, SchedulerConfig
from policies.slack import Deadlines, make_ordering
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager
from store.kv_sharded_manager import ShardedKVManager


@dataclass
class ControllerParts:
    """What a ``ReplicaController`` runs with, built once (``build_parts``)."""

    engine_config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    layout: Layout
    max_model_len: int
    num_blocks: int  # KV blocks per rank (the cache; with decode buckets the pool has one fewer)
    kv: KVCache
    one_rank_kv: KVCacheManager | None  # ``kv`` itself when it spans one rank
    scheduler: Scheduler
    predictor: RuntimePredictor | None  # fitted from the replica's steps, when one is used
    worker_spec: WorkerSpec
    executor: Executor
    eos_token_ids: frozenset[int]


def build_parts(
    model_dir: str | Path | None = None,
    config: EngineConfig | None = None,
    executor: Executor | None = None,
    worker_hooks: WorkerHooks | HooksFactory | None = None,
    **options: Any,
) -> ControllerParts:
    """``config`` holds the engine options; keyword ``options`` instead are converted through
    ``EngineConfig.from_options`` (not both). ``model_dir`` None: the tiny dense test model.
    ``executor``: run on it instead of building one; ``worker_hooks``: the workers' KV-cache
    provider and step hook (a picklable ``HooksFactory`` for worker actors)."""
    if config is None:
        config = EngineConfig.from_options(**options)
    elif options:
        raise ValueError(f"give config or keyword options, not both: {sorted(options)}")
    freeze_startup_heap()  # before the engine: its own objects stay collectable
    folder = Path(model_dir) if model_dir is not None else tiny_model_dir("dense")
    layout = Layout(config.tp, config.spp, config.kvp)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = config.torch_dtype(on_gpu)
    model = read_model_config(folder)
    if config.batch_invariant and model.is_moe:
        raise ValueError(
            "batch_invariant covers dense models; this one is MoE (its experts' GEMMs take "
            "a row count that depends on the batch)"
        )
    tokenizer = load_tokenizer(folder)
    max_model_len = config.context_len(model.max_position_embeddings)
    num_blocks = _num_blocks(config, model, dtype, max_model_len)
    decode_buckets = config.decode_buckets(num_blocks)
    # with padded decode steps the cache's last block is their scratch block, never pooled
    pooled = num_blocks - 1 if decode_buckets else num_blocks
    kv, one_rank_kv = _kv_manager(config, pooled, max_model_len)
    predictor, scheduler = _scheduler(config, kv)
    backend = config.attention_backend or ("flashinfer" if on_gpu else "torch")
    spec = WorkerSpec(
        model_dir=str(folder),
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        attention_backend=backend,
        block_size=config.block_size,
        num_blocks=num_blocks,
        layout=layout,
        pack_weights=config.pack_weights,
        batch_invariant=config.batch_invariant,
        decode_buckets=decode_buckets,
    )
    if executor is None:
        executor = _executor(config, model, spec, worker_hooks)
    if config.overlap_steps and (
        worker_hooks is not None or not isinstance(executor, LocalExecutor)
    ):
        raise ValueError(
            "overlap_steps needs the in-process executor and no worker hooks (a step hook "
            "or another executor would see placeholder tokens); leave it unset here"
        )
    eos = frozenset(t for t in (model.eos_token_ids or [tokenizer.eos_token_id]) if t is not None)
    return ControllerParts(
        engine_config=config,
        model_dir=folder,
        model_config=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        layout=layout,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        kv=kv,
        one_rank_kv=one_rank_kv,
        scheduler=scheduler,
        predictor=predictor,
        worker_spec=spec,
        executor=executor,
        eos_token_ids=eos,
    )


def _num_blocks(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    bs = config.block_size
    per_block = kv_cache_bytes_per_block(
        -(-model.num_hidden_layers // config.spp),
        bs,
        kv_heads_per_rank(model.num_key_value_heads, config.tp),
        model.head_dim,
        dtype,
    )
    # Enough for every running request at full context, within the memory budget.
    wanted = config.max_num_seqs * -(-max_model_len // bs)
    return max(1, min(wanted, config.kv_cache_memory // per_block))


def _kv_manager(
    config: EngineConfig, num_blocks: int, max_model_len: int
) -> tuple[KVCache, KVCacheManager | None]:
    """The KV manager, and the same manager again when it spans one rank."""
    bs = config.block_size
    pools = [BlockPool(num_blocks, bs) for _ in range(config.kvp)]
    if config.kvp == 1:
        # Data-parallel MoE attention workers each hold only their requests' KV, so a
        # prefix cached by one is not on another: no prefix caching across them.
        prefix = config.enable_prefix_caching and config.attention_workers <= 1
        one = KVCacheManager(pools[0], prefix)
        return one, one
    rank_tokens = config.kvp_rank_tokens
    if rank_tokens is None:
        per_rank = -(-max_model_len // config.kvp)
        rank_tokens = min(-(-per_rank // bs) * bs, num_blocks * bs)
    sharded = ShardedKVManager(
        pools,
        rank_tokens,
        config.enable_prefix_caching,
        choose_rank=choose_kvp_rank,  # Medha's KVP balancer
    )
    return sharded, None


def _scheduler(config: EngineConfig, kv: KVCache) -> tuple[RuntimePredictor | None, Scheduler]:
    """Medha's scheduling: a runtime predictor fitted from the replica's steps sizes chunks
    (``target_batch_time``) and predicts the prefill time deadlines rank by."""
    predictor: RuntimePredictor | None = None
    ordering: Ordering | None = config.ordering
    packer: Packer | None = None
    medha = config.target_batch_time is not None or config.decode_slowdown is not None
    packing = medha or config.attention_quota is not None
    if config.scheduling != "fcfs" or packing:
        predictor = RuntimePredictor(
            chunk_size=config.chunk_size or 512, min_samples=8, refit_every=8
        )
    if config.scheduling != "fcfs":
        assert predictor is not None
        deadlines = Deadlines(
            predictor,
            config.default_ttft_slo,
            config.ttft_slo_factor,
            config.min_ttft_slo,
            stages=config.spp,  # a prompt's chunks pipeline through the stages
        )
        ordering = make_ordering(config.scheduling, deadlines)
    if medha:
        assert predictor is not None
        packer = BatchPacker(
            TailStepTime(predictor),  # chunks sized to the steps' measured tail, not mean
            config.target_batch_time,
            config.max_prefill_share,
            max_chunk=config.chunk_size,
            decode_slowdown=config.decode_slowdown,
        )
    if config.attention_quota is not None:  # DualPath's intra-engine rule
        assert predictor is not None
        packer = AttentionQuotaPacker(
            predictor, config.attention_quota, max_chunk=config.chunk_size
        )
    scheduler = Scheduler(
        SchedulerConfig(
            config.token_budget,
            config.max_num_seqs,
            prefill_beside_decodes=config.prefill_beside_decodes,
        ),
        kv,
        ordering=ordering,
        chunk_rule=config.chunk_rule or FixedChunk(config.chunk_size),
        packer=packer,
    )
    return predictor, scheduler


def _executor(
    config: EngineConfig,
    model: ModelConfig,
    spec: WorkerSpec,
    worker_hooks: WorkerHooks | HooksFactory | None,
) -> Executor:
    if config.attention_workers:
        if worker_hooks is not None:
            raise ValueError("attention/expert disaggregation takes no worker hooks")
        from actors.moe.executor import build_moe_executor

        return build_moe_executor(config, model, spec)
    if spec.layout.world_size == 1:
        return LocalExecutor(spec, worker_hooks)
    from actors.engine.ray_executor import RayExecutor

    if isinstance(worker_hooks, WorkerHooks):
        raise ValueError(
            "a multi-worker layout takes worker hooks as a picklable factory "
            "(HooksFactory), built in each worker's process"
        )
    return RayExecutor(
        spec,
        use_compiled_graph=config.use_compiled_graph,
        hooks=worker_hooks,
        resources=config.worker_resources,
    )
