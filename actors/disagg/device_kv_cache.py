"""A decode worker's KV-cache provider on a GPU: an ordinary device allocation, shared with
prefill workers on the same GPU through CUDA IPC handles (``store.kv_cache_ipc``).

On the CPU a decode worker's cache lives in a shared-memory segment (``SharedKVCache``)
that the transfer layer and, with ``kv_route="ipc"``, prefill processes map. On a GPU no
transfer backend reaches device memory yet, so the cache is a plain allocation
(``kernels.kv_cache.allocate_kv_cache``) exported once per generation
(``KVCacheExporter``), and ``describe`` hands the export to the replica inside the
worker's ``KVTarget``; the replica puts it in every ``KVDestination``. Its endpoint names
the node and serves nothing: only a prefill worker on the same GPU, through the export,
reaches this cache.

``release`` (the worker sleeps) revokes the export and drops the tensors; the next
``allocate`` (the wake, or a worker restarted in the same process) makes new ones under
the next generation, so an importer still holding the old mapping sees it is stale. The
exporter's name carries a fresh token per provider, so a worker restarted in a new
process, whose generations start again, is never taken for the old one. A mapping that an
importer keeps open keeps the revoked allocation alive (torch's CUDA IPC reference
counts), so prefill replicas drop theirs when they sleep or update weights too.

This path runs the same code as the CPU tests' up to the allocation's device; it has not
run on a GPU here (``tests/gpu/test_pd_one_gpu.py`` is written for that).
"""

from __future__ import annotations

import uuid

from actors.disagg.kv_routes import KVTarget
from actors.engine.worker_hooks import CacheGeometry, KVCaches
from kernels.kv_cache import allocate_kv_cache
from store.kv_cache_ipc import KVCacheExporter
from store.transfer import Endpoint


class DeviceKVCache:
    """A ``KVCacheProvider``: the worker's cache on its device, exported (see the module
    doc)."""

    def __init__(
        self,
        endpoint_id: str,
        node_id: str,
        layers: tuple[int, int],
        heads: tuple[int, int],
        kvp_rank: int = 0,
    ) -> None:
        """``layers`` / ``heads``: the global layers and KV heads the worker holds;
        ``kvp_rank``: the KV-parallel rank whose pool it holds."""
        self.endpoint = Endpoint(endpoint_id, node_id)
        self.exporter_name = f"{endpoint_id}#{uuid.uuid4().hex[:12]}"
        self.layers, self.heads, self.kvp_rank = layers, heads, kvp_rank
        self.geometry: CacheGeometry | None = None
        self.kv_caches: KVCaches = []
        self.exporter: KVCacheExporter | None = None
        self._generation = 0  # the next allocation's

    def allocate(self, geometry: CacheGeometry) -> KVCaches:
        g = geometry
        if g.device.type == "cpu":
            raise ValueError(
                "a decode worker's cache on the CPU lives in a shared-memory segment "
                "(SharedKVCache): DeviceKVCache is for a GPU's"
            )
        if self.geometry is not None and g != self.geometry:
            raise ValueError("the decode cache does not match the worker's cache geometry")
        if (g.num_layers, g.num_kv_heads) != (
            self.layers[1] - self.layers[0],
            self.heads[1] - self.heads[0],
        ):
            raise ValueError("the decode cache's layers and heads do not match the worker's")
        if self.kv_caches:
            return self.kv_caches  # a worker restarted in this process: the same cache
        self.kv_caches = allocate_kv_cache(
            g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim, g.dtype, g.device
        )
        self.exporter = KVCacheExporter(
            self.exporter_name,
            self.kv_caches,
            node=self.endpoint.node_id,
            generation=self._generation,
        )
        self.geometry = g
        return self.kv_caches

    def release(self) -> int:
        """Revoke the export and drop the tensors (the worker sleeps)."""
        freed = sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)
        if self.exporter is not None:
            self._generation = self.exporter.revoke()
            self.exporter = None
        self.kv_caches = []
        return freed

    def describe(self) -> KVTarget:
        """How a prefill worker on the same GPU reaches this cache (no export while it is
        released)."""
        g = self.geometry
        if g is None:
            raise RuntimeError("the decode cache is allocated when its worker starts")
        export = self.exporter.export() if self.exporter is not None else None
        return KVTarget.of_cache(self.endpoint, self.layers, self.heads, g, self.kvp_rank, export)

    def close(self) -> None:
        self.release()
