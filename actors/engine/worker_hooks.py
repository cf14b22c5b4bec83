"""What a worker lets other components plug in, through its constructor: where its paged KV
cache lives, and what runs around each step. Nothing patches a worker or its model.

- ``KVCacheProvider.allocate(geometry)`` returns the worker's KV tensors, one ``(K, V)``
  pair per layer of its shard, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Called at set-up and again after a restart; a provider may hand back the same tensors
  (a decode replica's cache lives in a shared-memory segment that outlives the worker).
- ``StepHook`` sees every step: ``begin_step(plan, kv_caches)`` before its layers run,
  ``after_layer(layer, kv_cache)`` right after layer ``layer`` (the model's global layer
  index) wrote the step's KV, and ``end_step(plan, kv_caches)`` once the step's compute is
  done; what ``end_step`` returns comes back in ``StepResult.hook_report``.

``WorkerHooks`` bundles both. The in-process executor passes one to its worker as is; a
multi-worker layout takes a ``HooksFactory`` that each worker calls in its own process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from actors.engine.collectives import Layout
from actors.engine.step_plan import StepPlan
from kernels.kv_cache import allocate_kv_cache

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int  # layers of this worker's shard
    num_blocks: int
    block_size: int
    num_kv_heads: int  # KV heads this worker holds
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class KVCacheProvider(Protocol):
    def allocate(self, geometry: CacheGeometry) -> KVCaches: ...

    def release(self) -> int:
        """Free the memory of the caches it allocated (the worker sleeps; it drops its
        own references); the next ``allocate`` brings it back. Returns the bytes freed."""

    def describe(self) -> Any:
        """What the provider's owner needs to reach the cache (``Executor.hook_info``)."""


class StepHook(Protocol):
    def begin_step(self, plan: StepPlan, kv_caches: KVCaches) -> None: ...

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None: ...

    def end_step(self, plan: StepPlan, kv_caches: KVCaches) -> Any: ...


class PrivateKVCache:
    """The default provider: fresh tensors in the worker's own memory. Keeps what it
    allocated last (``kv_caches``), so the component that passed it in can read the cache
    (a prefill replica loading prefixes from the KV store) without reaching into the worker."""

    def __init__(self) -> None:
        self.kv_caches: KVCaches = []

    def allocate(self, geometry: CacheGeometry) -> KVCaches:
        g = geometry
        self.kv_caches = allocate_kv_cache(
            g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim, g.dtype, g.device
        )
        return self.kv_caches

    def release(self) -> int:
        """Drop the tensors it allocated (the worker sleeps)."""
        freed = sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)
        self.kv_caches = []
        return freed

    def describe(self) -> None:
        return None  # private: nobody else reaches it


@dataclass
class WorkerHooks:
    kv_cache: KVCacheProvider | None = None  # None: PrivateKVCache
    step: StepHook | None = None


# Builds a worker's hooks in the worker's own process from its (tp rank, stage, kvp rank)
# and the replica's layout; must pickle (Ray workers get it through their constructor).
HooksFactory = Callable[[tuple[int, int, int], Layout], WorkerHooks]
