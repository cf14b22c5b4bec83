"""A model worker: one (TP rank, pipeline stage, KVP rank) of a replica.

Owns its model shard, its layers' KV tensors and kernels; knows nothing of requests beyond
one step's plan. ``execute(plan, incoming)`` runs the step's tokens through its layers: a
first stage embeds the plan's token ids, later stages continue from the previous stage's
activations; the last stage samples (TP rank 0 answers for its group). Plain class; the Ray
executor makes it remote, the in-process executor calls it directly.

With ``WorkerSpec.decode_buckets`` (one-worker layouts), pure-decode steps run padded to a
batch-size bucket through ``DecodeGraphRunner`` (``actors/engine/decode_graphs.py``): as
replayed CUDA graphs on CUDA, eagerly on other devices; prefill and mixed steps, and
decode batches above the largest bucket, run eagerly as before.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engine.channel_bytes import use_channel_bytes
from actors.engine.collectives import Collectives, Layout
from actors.engine.decode_graphs import DecodeGraphRunner
from actors.engine.heap_freeze import freeze_startup_heap
from actors.engine.sampling import SampleSpec, TokenLogprob, sample_tokens
from actors.engine.step_plan import DeviceTokens, StepPlan, StepResult
from actors.engine.token_feed import feed, feed_sources
from actors.engine.worker_hooks import CacheGeometry, HooksFactory, PrivateKVCache, WorkerHooks
from actors.engine.worker_inputs import build_worker_inputs
from kernels.attention_metadata import AttentionMetadata
from kernels.batch_invariant import BatchInvariantAttention, tile_linears
from kernels.cpu_linear import PackedLinear, can_pack, pack_linears
from kernels.kv_parallel_attention import KVParallelAttention
from models import load_model
from models.sharding import ModelShard
from models.weight_update import read_weights, resolve_ref


@dataclass(frozen=True)
class WorkerSpec:
    """Picklable: how to build any worker of a replica."""

    model_dir: str
    dtype: str  # a torch dtype name, e.g. "float32"
    device: str  # "cpu" or "cuda"
    attention_backend: str
    block_size: int
    num_blocks: int  # per worker (each KVP rank has its own pool of this size)
    layout: Layout = Layout()
    pack_weights: bool | None = None
    batch_invariant: bool = False
    # Non-empty: pure-decode steps run padded to these batch sizes (CUDA graphs on CUDA,
    # actors/engine/decode_graphs.py), and the cache's last block (num_blocks - 1) is the
    # padded rows' scratch block, which the controller keeps out of its KV pool.
    decode_buckets: tuple[int, ...] = ()


log = logging.getLogger(__name__)


@dataclass
class StageOutput:
    """Activations handed from one pipeline stage to the next (over a compiled-graph channel;
    numpy, which is far cheaper than torch tensors on CPU channels)."""

    step_id: int
    hidden: np.ndarray  # [T, H]
    timings: list[tuple[int, float, float]] = field(default_factory=list)
    hook_reports: list[Any] = field(default_factory=list)  # of this and earlier stages


class Worker:
    def __init__(
        self,
        spec: WorkerSpec,
        coords: tuple[int, int, int] = (0, 0, 0),
        hooks: WorkerHooks | HooksFactory | None = None,
    ) -> None:
        """``hooks``: a ``WorkerHooks`` (in process), or a picklable factory called with
        the worker's coordinates and layout in the worker's own process."""
        freeze_startup_heap()  # a worker actor's process: before its shard and cache
        use_channel_bytes()
        self.spec = spec
        if callable(hooks):
            hooks = hooks(coords, spec.layout)
        self.hooks = hooks or WorkerHooks()
        self.tp_rank, self.stage, self.kvp_rank = coords
        self.coords = coords
        self.layout = spec.layout
        self.device = torch.device(spec.device)
        self.dtype = getattr(torch, spec.dtype)
        self.collectives: Collectives | None = None
        self.shard: ModelShard | None = None
        self.kv_caches: list = []
        self.kv_provider = self.hooks.kv_cache or PrivateKVCache()  # allocates kv_caches
        # every weight update since load, oldest first: as sent, but an object ref as its
        # value (zero-copy from the node's object store), since the process that put it
        # (a Conductor) may die before the shard is built again
        self.updates: list[Any] = []
        self._decode: DecodeGraphRunner | None = None  # built for the current shard and KV
        self._kept: DeviceTokens | None = None  # the last step's tokens (keep_tokens)

    # -- set-up ---------------------------------------------------------------------------
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def node_id(self) -> str:
        """The Ray node this worker runs on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A TCP port free on this node now, for the collectives' rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def setup(self, init_method: str | None = None) -> tuple[int, int, int]:
        """Join the collectives (when the layout has more than one worker), load this
        worker's shard and allocate its KV cache. Returns the worker's coordinates."""
        layout = self.layout
        if layout.world_size > 1:
            if init_method is None:
                raise ValueError("a multi-worker layout needs an init_method for collectives")
            self.collectives = Collectives(layout, self.coords, init_method, self.device)
        self.shard = self._build_shard()
        self.kv_caches = self._allocate_kv()
        return self.coords

    def _build_shard(self) -> ModelShard:
        """This worker's part of the model: the stored weights, with every tensor updated
        since load (``updates``, later ones winning) in their place."""
        spec, layout = self.spec, self.layout
        model = load_model(
            Path(spec.model_dir),
            self.dtype,
            self.device,
            spec.attention_backend,
            {n: t for source in self.updates for n, t in read_weights(source).items()},
        )
        reduce = self.collectives.all_reduce_tp if self.collectives else None
        backend = None
        if layout.kvp > 1:
            assert self.collectives is not None
            backend = KVParallelAttention(self.collectives.all_gather_kvp)
        shard = ModelShard(model, self.stage, layout.spp, self.tp_rank, layout.tp, reduce, backend)
        del model
        if spec.pack_weights if spec.pack_weights is not None else can_pack(shard):
            pack_linears(shard)  # fp32 CPU: oneDNN-prepacked weights, same arithmetic
        if spec.batch_invariant:  # fixed-shape GEMMs and one per-row attention kernel
            tile_linears(shard)
            shard.attention_backend = BatchInvariantAttention()
        if self.hooks.step is not None:
            shard.set_layer_hook(self.hooks.step)
        return shard

    def _allocate_kv(self) -> list:
        assert self.shard is not None
        geometry = CacheGeometry(
            self.shard.num_layers,
            self.spec.num_blocks,
            self.spec.block_size,
            self.shard.num_kv_heads,
            self.shard.config.head_dim,
            self.dtype,
            self.device,
        )
        return self.kv_provider.allocate(geometry)

    # -- weights and memory between rollout phases ------------------------------------------
    def update_weights(self, *sources: Any) -> None:
        """Load new weights (each source as ``models.weight_update.read_weights`` takes it,
        already checked by the controller; later ones win) in place of the current ones,
        building the shard once. The KV cache is kept (its contents are stale: the
        controller forgets them). If building fails, the weights before the update are
        built again and the error raised: the worker never stays without weights."""
        before = list(self.updates)
        self.updates.extend(resolve_ref(source) for source in sources)
        if self.shard is not None:  # asleep at level 2: built on wake_up
            self.shard = self._decode = None  # free the old weights before the new ones
            try:
                self.shard = self._build_shard()
            except BaseException:
                self.updates = before
                self.shard = self._build_shard()
                raise

    def sleep(self, level: int) -> int:
        """Free the KV cache (level 1), and the weights too (level 2); ``wake_up`` brings
        them back (the weights as last updated). A KV cache shared with a transfer layer
        (a P/D decode worker's) frees its memory and keeps its address
        (``SharedKVCache.release``). Returns the bytes freed."""
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level}"
            )
        self.kv_caches = []
        self._decode = None  # its graphs hold the KV tensors (and the weights)
        freed = self.kv_provider.release()
        if level == 2 and self.shard is not None:
            freed += _nbytes(_shard_tensors(self.shard))
            self.shard = None
        return freed

    def wake_up(self) -> None:
        """Undo ``sleep``: weights (if freed) and an empty KV cache of the same size."""
        if self.shard is None:
            self.shard = self._build_shard()
        if not self.kv_caches:
            self.kv_caches = self._allocate_kv()

    def ping(self) -> bool:
        return True

    def hook_info(self) -> Any:
        """What this worker's KV-cache provider tells its owner (``describe``)."""
        provider = self.hooks.kv_cache
        return provider.describe() if provider is not None else None

    # -- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, incoming: StageOutput | None = None
    ) -> StageOutput | StepResult:
        began = time.time()
        shard = self.shard
        assert shard is not None, "call setup() first"
        timings = list(incoming.timings) if incoming is not None else []
        reports = list(incoming.hook_reports) if incoming is not None else []
        graphs = self._decode_runner(plan)
        inputs = build_worker_inputs(  # the runner copies a step's inputs in from the host
            plan,
            self.kvp_rank,
            self.layout.kvp,
            self.spec.block_size,
            "cpu" if graphs is not None else self.device,
        )
        sources = feed_sources(inputs.entries, self._kept) if plan.keep_tokens else None
        exchange = getattr(inputs.meta, "exchange", None)
        step_hook = self.hooks.step
        if step_hook is not None:
            step_hook.begin_step(plan, self.kv_caches)
        if inputs.entries or exchange is not None:
            hidden_in = None
            if incoming is not None:
                hidden_in = torch.from_numpy(np.array(incoming.hidden)).to(self.device)
            fed = None
            if sources is not None:
                kept, feeds = self._kept, sources
                assert kept is not None
                fed = lambda ids: feed(ids, feeds, kept)  # noqa: E731
            if graphs is not None:
                assert isinstance(inputs.meta, AttentionMetadata)
                hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.meta, fed)
            else:
                if fed is not None:
                    inputs.input_ids = fed(inputs.input_ids)
                hidden = shard(
                    inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, hidden_in
                )
        else:  # nothing of this step runs on this KVP rank
            hidden = torch.zeros(0, shard.config.hidden_size, dtype=self.dtype)
        timings.append((self.stage, began, time.time()))
        if step_hook is not None:
            reports.append(step_hook.end_step(plan, self.kv_caches))
        if not shard.is_last:
            return StageOutput(plan.step_id, hidden.cpu().numpy(), timings, reports)
        tokens: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        unread = None
        if self.tp_rank == 0 and inputs.sample_rows:
            rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=hidden.device)
            logits = shard.compute_logits(hidden.index_select(0, rows))
            specs = inputs.sample_specs
            if plan.keep_tokens and all(_greedy_only(s) for s in specs):
                # what sample_tokens computes for such rows, left on the device
                unread = DeviceTokens(inputs.sample_ids, logits.float().argmax(dim=-1))
            else:
                for rid, s in zip(inputs.sample_ids, sample_tokens(logits, specs), strict=True):
                    tokens[rid] = s.token_id
                    if s.logprob is not None:
                        logprobs[rid] = s.logprob
        self._kept = unread  # None unless keep_tokens
        if plan.keep_tokens and unread is None:  # sampled on the host: kept on the device too
            values = torch.tensor(list(tokens.values()), dtype=torch.int64, device=hidden.device)
            self._kept = DeviceTokens(list(tokens), values)
        return StepResult(plan.step_id, tokens, timings, reports, logprobs, unread)

    def _decode_runner(self, plan: StepPlan) -> DecodeGraphRunner | None:
        """The decode runner when this step is pure decode (one token per request) and one
        runs here, else None (the step runs eagerly). Built again whenever the shard or the
        KV tensors changed (a graph holds their addresses). On CUDA, only when its graphs
        can be captured: padding without capture would only add work there."""
        buckets = self.spec.decode_buckets
        if (
            not buckets
            or self.layout.world_size != 1
            or self.hooks.step is not None
            or not plan.entries
            or len(plan.entries) > max(buckets)
            or any(e.num_tokens != 1 for e in plan.entries)
        ):
            return None
        runner = self._decode
        if (
            runner is None
            or runner.shard is not self.shard
            or runner.kv_caches is not self.kv_caches
        ):
            assert self.shard is not None
            runner = DecodeGraphRunner(
                self.shard,
                self.kv_caches,
                self.spec.block_size,
                scratch_block=self.spec.num_blocks - 1,
                buckets=buckets,
            )
            if self.device.type == "cuda" and not runner.capture:
                log.info("decode steps run eagerly, no CUDA graphs: %s", "; ".join(runner.blockers))
            self._decode = runner
        if self.device.type == "cuda" and not runner.capture:
            return None
        return runner

    def shutdown(self) -> None:
        if self.collectives is not None:
            self.collectives.close()
            self.collectives = None


def _greedy_only(spec: SampleSpec) -> bool:
    """A row whose token is its logits' argmax, with nothing else to return."""
    return spec.plain and spec.temperature == 0.0 and spec.logprobs is None


def _nbytes(tensors: Any) -> int:
    """Bytes held by a tensor or a (nested) list or tuple of tensors; storage shared by
    several views counts once."""
    seen: set[int] = set()
    total = 0
    stack = [tensors]
    while stack:
        t = stack.pop()
        if isinstance(t, list | tuple):
            stack.extend(t)
        elif isinstance(t, torch.Tensor):
            try:
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # an opaque (oneDNN-packed) tensor
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


def _shard_tensors(shard: ModelShard) -> list[torch.Tensor]:
    """A shard's parameters and buffers, with the prepacked copies ``pack_linears`` adds."""
    extra = [t for m in shard.modules() if isinstance(m, PackedLinear) for t in m.stored()]
    return [*shard.parameters(), *shard.buffers(), *extra]
