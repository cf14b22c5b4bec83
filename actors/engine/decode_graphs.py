"""Pure-decode steps through static buffers, one CUDA graph per batch-size bucket.

A pure-decode step (every sequence decodes exactly one token) of ``B`` sequences is padded
to its bucket ``N`` and table width ``W`` (``decode_buckets``, ``decode_padding``), copied
into that shape's static input buffers, and run:

- on CUDA, when nothing in the shard blocks capture (``capture_blockers``), as a replay of
  the graph captured for that shape (captured on first use after two warm-up runs on a side
  stream; every graph of a runner in one memory pool, so ``capture`` captures a width's
  buckets largest first and the smaller ones reuse the larger's memory);
- on any other device, eagerly through the same buffers (copy in, run, slice out), which
  is how CPU tests cover the padding and the fixed-shape attention.

The model's output rows ``B..N-1`` are discarded; the live rows come back as a view of the
graph's output, valid until the runner's next step. Prefill and mixed steps never come here.

Graph key (``GraphKey``): what changes the captured kernels or their shapes: the bucket, the
table width, the block size, the model and KV dtype, the device, and the attention backend
(by name). A runner belongs to one model shard and one set of KV tensors (a graph records
their addresses): the worker builds a new runner when either changes (weights updated, KV
cache freed by sleep and allocated again).

What keeps the decode path capturable: the torch backend's fixed-shape decode attention
reads nothing on the host (``kernels/attention_torch.py``: ``fixed_decode_attention``; the
eager path's per-step plan does ``.tolist()`` and builds index tensors from Python lists, so
it is never used here); RoPE's tables are cast to the model's dtype before capture (the
warm-up runs make them); the step's metadata is a new object over the static buffers, never
a value read back. What still blocks capture is listed by ``capture_blockers``: flashinfer
(its ``plan`` runs on the host per step; its CUDA-graph wrapper is not wired), MoE layers
(``kernels/moe.py`` counts rows per expert with ``.tolist()``), layer hooks (Python between
layers: KV streaming and loading) and pipeline stages. Tensor and KV parallelism never reach
the runner (the worker uses it for one-worker layouts only).

Status: unit-tested on CPU through the padded eager path, which runs the same buffers,
metadata and attention; captured and replayed on one H200 (tests/gpu/README.md: its test
passed, and the decode bench measured it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from actors.engine.decode_buckets import choose_bucket, choose_table_width, normalize_buckets
from actors.engine.decode_padding import PaddedDecode, fixed_metadata, pad_decode, padding_rows
from kernels.attention_metadata import AttentionMetadata
from models.sharding import ModelShard

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (allocator and cuBLAS set-up)


@dataclass(frozen=True)
class GraphKey:
    """What one captured graph is valid for: a replay with any other value of these needs
    another graph."""

    batch: int  # the bucket: rows of every static input
    table_width: int  # block-table columns: the fixed-shape attention gathers this many blocks
    block_size: int  # tokens per block: keys per row = table_width * block_size
    dtype: torch.dtype  # model and KV-cache dtype: which GEMM and attention kernels
    device: str  # e.g. "cuda:0": a graph replays on the device it was captured on
    backend: str  # attention backend name


def capture_blockers(shard: ModelShard) -> list[str]:
    """Why this shard's decode step cannot be captured in a CUDA graph (empty: it can)."""
    reasons = []
    backend = shard.attention_backend
    if not getattr(backend, "graph_safe_decode", False):
        reasons.append(
            f"attention backend {backend.name!r} prepares each step on the host "
            "(flashinfer's plan; its CUDA-graph wrapper is not wired)"
        )
    if shard.config.is_moe:
        reasons.append("MoE layers count rows per expert on the host (kernels/moe.py: .tolist())")
    if shard.layer_hook is not None:
        reasons.append("a layer hook runs Python between layers (KV streaming or loading)")
    if not (shard.is_first and shard.is_last):
        reasons.append("a pipeline stage takes or hands over activations between workers")
    return reasons


@dataclass
class _StaticStep:
    """One shape's input buffers (fixed addresses), and its graph and output once captured."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    context_lens: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, W]
    slot_mapping: torch.Tensor  # [N]
    query_start: torch.Tensor  # [N + 1] = arange(N + 1), never written
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # [N, H] the graph's output

    def copy_in(self, step: PaddedDecode) -> None:
        self.input_ids.copy_(step.input_ids, non_blocking=True)
        self.positions.copy_(step.positions, non_blocking=True)
        self.context_lens.copy_(step.context_lens, non_blocking=True)
        self.block_tables.copy_(step.block_tables, non_blocking=True)
        self.slot_mapping.copy_(step.slot_mapping, non_blocking=True)


class DecodeGraphRunner:
    """Runs pure-decode steps of one model shard over one set of KV tensors.

    ``scratch_block``: a block of ``kv_caches`` that no request is ever given (padded rows
    write there; ``decode_padding``). ``buckets``: the batch sizes. ``capture``: None
    captures on CUDA when ``capture_blockers`` is empty; False never captures; a non-CUDA
    device never captures."""

    def __init__(
        self,
        shard: ModelShard,
        kv_caches: KVCaches,
        block_size: int,
        scratch_block: int,
        buckets: tuple[int, ...] | list[int],
        capture: bool | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("the decode runner needs the shard's KV caches")
        k_cache = kv_caches[0][0]
        num_blocks = int(k_cache.shape[0])
        if not 0 <= scratch_block < num_blocks or num_blocks < 2:
            raise ValueError(
                f"scratch block {scratch_block} must be one of the cache's {num_blocks} "
                "blocks, and at least one other block must hold requests"
            )
        self.shard = shard
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = normalize_buckets(buckets)
        self.device = k_cache.device
        self.dtype = k_cache.dtype
        self.max_blocks = num_blocks - 1  # the longest table a request can have
        self.blockers = capture_blockers(shard)
        can = self.device.type == "cuda" and not self.blockers
        self.capture = can if capture is None else (capture and can)
        self._steps: dict[GraphKey, _StaticStep] = {}
        self._pool: Any = None  # one CUDA memory pool for every graph (an opaque handle)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        return sum(1 for s in self._steps.values() if s.graph is not None)

    def fits(self, num_seqs: int) -> bool:
        """Whether a decode step of this many sequences runs here (else: eagerly)."""
        return 1 <= num_seqs <= self.max_batch

    def key(self, batch: int, width: int) -> GraphKey:
        return GraphKey(
            batch=batch,
            table_width=width,
            block_size=self.block_size,
            dtype=self.dtype,
            device=str(self.device),
            backend=self.shard.attention_backend.name,
        )

    def shape_for(self, num_seqs: int, max_context_len: int) -> tuple[int, int]:
        """(bucket, table width) of a decode step."""
        bucket = choose_bucket(self.buckets, num_seqs)
        if bucket is None:
            raise ValueError(f"{num_seqs} sequences exceed the largest bucket {self.max_batch}")
        needed = max(-(-max_context_len // self.block_size), 1)
        return bucket, choose_table_width(needed, self.max_blocks)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        feed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One pure-decode step (``input_ids, positions [B]`` and its metadata, on any
        device; the CPU is cheapest, one copy into the static buffers) -> the final hidden
        states of its ``B`` rows, ``[B, H]``, valid until the next ``run``. ``feed``: maps
        the live rows' token ids, once on the device, to the ids the step runs on
        (``token_feed.feed``: tokens the previous step sampled there)."""
        bucket, width = self.shape_for(int(input_ids.shape[0]), meta.max_context_len)
        padded = pad_decode(input_ids, positions, meta, bucket, width, self.scratch_block)
        step = self._step(bucket, width)
        step.copy_in(padded)
        if feed is not None:
            live = step.input_ids[: padded.num_live]
            live.copy_(feed(live))
        if step.graph is not None:
            step.graph.replay()
            hidden = step.hidden
            assert hidden is not None
        else:
            hidden = self._forward(step)
        return hidden[: padded.num_live]

    @torch.inference_mode()
    def capture_width(self, width: int) -> None:
        """Capture every bucket at this table width now, largest first (so the smaller
        graphs reuse the larger's pool memory); nothing without capture."""
        for bucket in sorted(self.buckets, reverse=True):
            self._step(bucket, width)

    # -- internals ------------------------------------------------------------------------
    def _step(self, bucket: int, width: int) -> _StaticStep:
        key = self.key(bucket, width)
        step = self._steps.get(key)
        if step is None:
            step = self._allocate(bucket, width)
            if self.capture:
                self._capture(step)
            self._steps[key] = step
        return step

    def _allocate(self, bucket: int, width: int) -> _StaticStep:
        """Buffers of one shape, filled as a step of padded rows only (what warm-up and
        capture run)."""
        pad = padding_rows(bucket, width, self.scratch_block, self.block_size)
        on = self.device
        return _StaticStep(
            input_ids=pad.input_ids.to(on),
            positions=pad.positions.to(on),
            context_lens=pad.context_lens.to(on),
            block_tables=pad.block_tables.to(on),
            slot_mapping=pad.slot_mapping.to(on),
            query_start=torch.arange(bucket + 1, dtype=torch.int64, device=on),
        )

    def _forward(self, step: _StaticStep) -> torch.Tensor:
        meta = fixed_metadata(
            step.context_lens,
            step.block_tables,
            step.slot_mapping,
            step.query_start,
            self.block_size,
        )  # a new object per call: backends may key per-step work on its identity
        return self.shard(step.input_ids, step.positions, self.kv_caches, meta)

    def _capture(self, step: _StaticStep) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(step)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (transfers, another replica) may go on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.hidden = self._forward(step)
        step.graph = graph
