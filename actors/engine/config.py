"""One replica's engine options, with their defaults in one place (``EngineConfig``).

Built from keyword arguments by ``EngineConfig.from_options`` (a deployment config's
``engine`` section, ``LLM(model, **options)``), which names any key that is not an option.
Sizes that depend on the model (the context length, the KV pool) are derived here too, so
the ingress and the replica agree on them. No torch at import: the ingress reads this file.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actors.engine.decode_buckets import default_buckets, normalize_buckets
from actors.engine.defaults import CHUNK_SIZE, DECODE_SLOWDOWN, PREFILL_BESIDE_DECODES, TOKEN_BUDGET
from policies.chunking import ChunkRule
from policies.ordering import Ordering
from policies.slack import POLICIES

if TYPE_CHECKING:
    import torch


def _valid_cores(cores: tuple[int, ...] | list[int]) -> bool:
    """Non-empty, distinct core ids of this machine, and an affinity API to pin them."""
    count = os.cpu_count() or 1
    ids = list(cores)
    return (
        bool(ids)
        and len(set(ids)) == len(ids)
        and all(type(c) is int and 0 <= c < count for c in ids)
        and hasattr(os, "sched_setaffinity")
    )


@dataclass(frozen=True)
class EngineConfig:
    """``num_blocks`` and ``kv_cache_memory`` are per worker (per KVP rank: each holds its
    own pool); ``num_blocks=None`` sizes the pool from ``kv_cache_memory``.
    ``kvp_rank_tokens``: most tokens of one request one KVP rank holds before it spills to
    the next (a multiple of ``block_size``; default: what the rank's pool holds, split
    evenly so a full-context request fits across the ranks). ``dtype`` may be a torch dtype
    or its name (``"float32"``); ``None`` picks bf16 on GPU, fp32 on CPU.

    Scheduling (Medha): ``scheduling`` orders prefills, "fcfs" (default), "edf", "lrs" or
    "ilrs" (``policies.slack``), by TTFT deadlines: a request's ``ttft_slo`` (sampling
    parameter), else ``default_ttft_slo``, else ``ttft_slo_factor`` x its predicted prefill
    time alone, at least ``min_ttft_slo`` seconds. A step that runs decodes carries at most
    ``prefill_beside_decodes`` prompt tokens, all prefills together (None: what its decodes
    leave of ``token_budget``; under any packer too). Prompt chunks are fixed (``chunk_size``, or
    ``chunk_rule``'s) unless a target turns on Medha's batch packer
    (``policies.batch_packer``: adaptive chunks and prefill-prefill batching, the short
    prefills' share of a step at most ``max_prefill_share``, ``chunk_size`` capping a
    chunk): ``target_batch_time`` (seconds, the decodes' TPOT target) or
    ``decode_slowdown`` (k: each step at most k times its decodes' own predicted step; not
    beside ``target_batch_time``, ``attention_quota`` or a ``chunk_rule``).
    ``attention_quota`` (seconds; DualPath's intra-engine rule, instead of
    ``target_batch_time``) fills each step in FIFO order while its predicted attention time
    stays within the quota and chunks the request that would overflow it
    (``policies.dualpath.AttentionQuotaPacker``). All use the replica's runtime predictor
    (``placement.runtime_predictor``), fitted online from its measured steps."""

    dtype: torch.dtype | str | None = None
    device: str | None = None
    attention_backend: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    token_budget: int = TOKEN_BUDGET  # these defaults' measurements: actors/engine/defaults.py
    prefill_beside_decodes: int | None = PREFILL_BESIDE_DECODES  # of a step that runs decodes
    max_num_seqs: int = 256
    chunk_size: int | None = CHUNK_SIZE
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    ordering: Ordering | None = None
    chunk_rule: ChunkRule | None = None
    pack_weights: bool | None = None
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    kvp_rank_tokens: int | None = None
    use_compiled_graph: bool = True
    # every token's sampled id and logprobs bitwise the same whatever else is in its step
    # and wherever its prompt is chunked (kernels/batch_invariant.py; single-worker dense
    # models only); costs throughput (bench/batch_invariance.py)
    batch_invariant: bool = False
    # Pure-decode steps as CUDA graphs, one per batch-size bucket, inputs padded to the bucket
    # (actors/engine/decode_graphs.py; prefill and mixed steps stay eager). Off by default:
    # it ran on one GPU once (tests/gpu/README.md), its bfloat16 margins on the pretrained
    # model are not yet measured there. True on CPU runs the same padded path
    # without capture (how CPU tests cover it). One KV block is then kept out of the pool as
    # the padded rows' scratch block. Needs tp = spp = kvp = 1, no MoE workers, not
    # batch_invariant.
    cuda_graphs: bool = False
    # the buckets (None: 1, 2, 4, then every multiple of 8 up to min(256, max_num_seqs))
    cuda_graph_sizes: tuple[int, ...] | list[int] | None = None
    # Host work overlapping the device's (actors/engine/token_feed.py): while a step runs,
    # the next one is scheduled, planned and submitted, its decodes fed the tokens this
    # step samples on the device, and the step's tokens are read back after. Steps of
    # requests with penalties or a response_format run one at a time (their next sampling
    # needs the token's value). Off by default: tested on CPU (where the worker runs each
    # step as it is submitted, so nothing overlaps there), never run on a GPU. Needs the
    # in-process single-worker engine (tp = spp = kvp = 1, no attention/expert workers).
    overlap_steps: bool = False
    # Ray custom resources each worker actor of a multi-worker layout reserves, e.g. a
    # region's node resource (``RegionConfig.node_resource``): its workers then go only on
    # the nodes that carry it. None: no custom resource.
    worker_resources: dict[str, float] | None = None
    # CPU cores the serving engine thread runs on (Linux; the serving loop pins it, and
    # torch's threads it starts inherit the set). The model runs on that thread only with
    # tp = spp = kvp = 1 and no MoE workers. Keep other processes off these cores (start
    # Ray under ``taskset -c <the other cores>``) so the engine is never preempted.
    cpu_cores: tuple[int, ...] | list[int] | None = None
    # MoE attention/expert disaggregation (actors/moe): attention_workers data-parallel
    # attention workers and expert_workers expert workers holding expert_slots whole
    # experts each (default: just enough for every expert; spare slots hold copies of hot
    # experts); the decode batch in micro_batches micro-batches (None: the paper's rule
    # m >= 2 (1 + Tc / Tf) from the cost model). 0 workers: the colocated model.
    attention_workers: int = 0
    expert_workers: int = 0
    expert_slots: int | None = None
    micro_batches: int | None = None
    # re-plan the expert placement from observed rows per expert at most this often (None:
    # the placement stays as started)
    rebalance_experts_s: float | None = None
    # A heterogeneous MoE plan: the cores (Linux) the attention (expert) worker actors run
    # on, split into disjoint runs among the workers of that kind (shared when fewer cores
    # than workers), each worker's torch threads = its cores (None: the OS's choice and
    # torch's default threads); Ray custom resources each attention (expert) worker
    # reserves on top of worker_resources, to put the two kinds on different nodes.
    attention_cores: tuple[int, ...] | list[int] | None = None
    expert_cores: tuple[int, ...] | list[int] | None = None
    attention_resources: dict[str, float] | None = None
    expert_resources: dict[str, float] | None = None
    # each MoE worker's emulated compute link, bytes/s: the activations it sends pay it
    # (attention-expert traffic on the links DualPath's bench emulates; None: not limited)
    moe_link_bytes_per_s: float | None = None
    moe_in_process: bool = False  # the MoE workers in this process (no Ray), for tests
    scheduling: str = "fcfs"
    default_ttft_slo: float | None = None
    ttft_slo_factor: float = 3.0
    min_ttft_slo: float = 0.0
    target_batch_time: float | None = None
    decode_slowdown: float | None = DECODE_SLOWDOWN
    max_prefill_share: float = 0.5
    attention_quota: float | None = None

    def __post_init__(self) -> None:
        if self.scheduling not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling!r}; known: {', '.join(POLICIES)}"
            )
        if self.scheduling != "fcfs" and self.ordering is not None:
            raise ValueError("give scheduling or an ordering object, not both")
        if self.target_batch_time is not None and self.attention_quota is not None:
            raise ValueError(
                "give target_batch_time (Medha's packer) or attention_quota (DualPath's), not both"
            )
        for name in ("default_ttft_slo", "target_batch_time", "attention_quota"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds or None")
        if self.decode_slowdown is not None:
            if not self.decode_slowdown > 1:
                raise ValueError(
                    "decode_slowdown must be above 1 (a step's time over its decodes' alone) "
                    f"or None for fixed chunks, got {self.decode_slowdown}"
                )
            for other in ("target_batch_time", "attention_quota", "chunk_rule"):
                if getattr(self, other) is not None:
                    raise ValueError(f"give decode_slowdown or {other}, not both")
        if not self.ttft_slo_factor > 0 or self.min_ttft_slo < 0:
            raise ValueError("ttft_slo_factor must be positive and min_ttft_slo non-negative")
        if not 0.0 <= self.max_prefill_share <= 1.0:
            raise ValueError(f"max_prefill_share must be in [0, 1], got {self.max_prefill_share}")
        if self.prefill_beside_decodes is not None and self.prefill_beside_decodes <= 0:
            raise ValueError(
                "prefill_beside_decodes must be positive (prompt tokens a step may carry "
                f"beside decodes) or None for the whole token budget, got "
                f"{self.prefill_beside_decodes}"
            )
        for name in ("block_size", "kv_cache_memory", "token_budget", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("worker_resources", "attention_resources", "expert_resources"):
            for res, amount in (getattr(self, name) or {}).items():
                if not res or not amount > 0:
                    raise ValueError(
                        f"{name} must map resource names to positive amounts, got "
                        f"{res!r}: {amount!r}"
                    )
        if self.moe_link_bytes_per_s is not None and not self.moe_link_bytes_per_s > 0:
            raise ValueError("moe_link_bytes_per_s must be a positive number of bytes/s or None")
        moe_only = ("attention_cores", "expert_cores", "attention_resources", "expert_resources")
        for name in (*moe_only, "moe_link_bytes_per_s"):
            if getattr(self, name) is not None and not self.attention_workers:
                raise ValueError(f"{name} is for MoE workers: it needs attention_workers >= 1")
        for name in ("attention_cores", "expert_cores"):
            cores = getattr(self, name)
            if cores is not None and not _valid_cores(cores):
                raise ValueError(
                    f"{name} must be a non-empty list of distinct core ids in "
                    f"0..{(os.cpu_count() or 1) - 1}, got {cores!r}"
                )
        if self.cpu_cores is not None:
            self._check_cpu_cores(self.cpu_cores)
        for name in ("tp", "spp", "kvp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (self.attention_workers > 0) != (self.expert_workers > 0) or min(
            self.attention_workers, self.expert_workers
        ) < 0:
            raise ValueError(
                "attention/expert disaggregation needs attention_workers >= 1 and "
                f"expert_workers >= 1 together, got {self.attention_workers} and "
                f"{self.expert_workers}"
            )
        if self.batch_invariant and (
            (self.tp, self.spp, self.kvp) != (1, 1, 1) or self.attention_workers
        ):
            raise ValueError(
                "batch_invariant holds for the single-worker engine (tp = spp = kvp = 1, no "
                "attention/expert workers); scale out with replicas instead"
            )
        if self.cuda_graphs and (
            (self.tp, self.spp, self.kvp) != (1, 1, 1)
            or self.attention_workers
            or self.batch_invariant
        ):
            raise ValueError(
                "cuda_graphs runs the single-worker engine (tp = spp = kvp = 1, no "
                "attention/expert workers, not batch_invariant); leave it unset for this layout"
            )
        if self.overlap_steps and (
            (self.tp, self.spp, self.kvp) != (1, 1, 1) or self.attention_workers
        ):
            raise ValueError(
                "overlap_steps runs the in-process single-worker engine (tp = spp = kvp = 1, "
                "no attention/expert workers); leave it unset for this layout"
            )
        if self.cuda_graph_sizes is not None:
            normalize_buckets(self.cuda_graph_sizes)  # ValueError: not positive integers
        if self.attention_workers and (self.tp, self.spp, self.kvp) != (1, 1, 1):
            raise ValueError("attention/expert disaggregation runs with tp = spp = kvp = 1")
        for name in (
            "num_blocks",
            "max_model_len",
            "chunk_size",
            "kvp_rank_tokens",
            "expert_slots",
            "micro_batches",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")

    def _check_cpu_cores(self, cores: tuple[int, ...] | list[int]) -> None:
        count = os.cpu_count() or 1
        if not cores or any(type(c) is not int or not 0 <= c < count for c in cores):
            raise ValueError(
                f"cpu_cores must be a non-empty list of core ids in 0..{count - 1}, got {cores!r}"
            )
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("cpu_cores needs sched_setaffinity (Linux); leave it unset here")
        if (self.tp, self.spp, self.kvp) != (1, 1, 1) or self.attention_workers:
            raise ValueError(
                "cpu_cores pins the engine thread, where the model runs only with "
                "tp = spp = kvp = 1 and no MoE workers; leave it unset for this layout"
            )

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config with ``options`` over the defaults; an unknown key is a ValueError
        naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(map(repr, unknown))}; "
                f"known options: {', '.join(sorted(known))}"
            )
        return cls(**options)

    def torch_dtype(self, on_gpu: bool) -> torch.dtype:
        """``dtype`` as a torch dtype (given by name in config files); bf16 on GPU and fp32
        on CPU when unset."""
        import torch

        dtype = self.dtype
        if dtype is None:
            return torch.bfloat16 if on_gpu else torch.float32
        if not isinstance(dtype, str):
            return dtype
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
        return resolved

    def decode_buckets(self, num_blocks: int) -> tuple[int, ...]:
        """The batch sizes pure-decode steps are padded to (``cuda_graphs``; captured on
        CUDA, padded only elsewhere), or () when decode steps run as they come."""
        if not self.cuda_graphs:
            return ()
        if num_blocks < 2:
            raise ValueError("cuda_graphs needs at least 2 KV blocks (one is its scratch)")
        if self.cuda_graph_sizes is not None:
            return normalize_buckets(self.cuda_graph_sizes)
        return default_buckets(min(256, self.max_num_seqs))

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest request (prompt + generated tokens): ``max_model_len`` capped by the
        model's positions. The one place this is derived."""
        if self.max_model_len is None:
            return max_position_embeddings
        return min(self.max_model_len, max_position_embeddings)
