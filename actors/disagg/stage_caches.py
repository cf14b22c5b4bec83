"""A prefill replica's view of its pipeline stages' KV caches (Mooncake's chunked pipeline
parallelism, ``spp`` > 1, with the KV store).

Each stage worker keeps its layers' paged cache in a shared-memory segment
(``SharedKVCache``, one node); the replica actor maps every stage's segment and lays the
views out as one model-wide cache, one ``(K, V)`` pair per global layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``, in the same memory the workers
compute in. So the replica reads a stored prefix into its blocks, and writes finished
prompts' blocks back, with the same store client calls as a single-worker replica.
Only whole-head stages (``tp`` = 1) tile the model this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.disagg.kv_routes import KVTarget
from actors.engine.worker_hooks import KVCaches
from store.shared_segment import SharedSegment


class StageCaches:
    """``kv_caches``: every layer's ``(K, V)``, mapped from the stage workers' segments."""

    def __init__(self, targets: Sequence[KVTarget], dtype: torch.dtype) -> None:
        """``targets``: each stage worker's cache (``SharedKVCache.describe``); together
        they must hold every layer once, each with every KV head."""
        ordered = sorted(targets, key=lambda t: t.layers[0])
        heads = {t.heads for t in ordered}
        if len(heads) != 1:
            raise ValueError("the KV store reads a prefill replica's stages with tp=1 only")
        if any(a.layers[1] != b.layers[0] for a, b in zip(ordered, ordered[1:], strict=False)):
            raise ValueError("the stages' layers must tile the model")
        self.segments: list[SharedSegment] = []
        self.kv_caches: KVCaches = []
        size = torch.empty((), dtype=dtype).element_size()
        for t in ordered:
            name = t.endpoint.segment_name
            if name is None:
                raise ValueError(f"stage cache {t.endpoint.endpoint_id} has no segment")
            seg = SharedSegment.attach(name, t.endpoint.segment_bytes)
            self.segments.append(seg)
            num_heads = t.heads[1] - t.heads[0]
            shape = (t.num_blocks, t.block_size, num_heads, t.head_bytes // size)
            per = t.piece_bytes * t.num_blocks // size
            flat = torch.frombuffer(seg.array, dtype=dtype)
            for i in range(t.layers[1] - t.layers[0]):
                k = flat[(2 * i) * per : (2 * i + 1) * per].view(shape)
                v = flat[(2 * i + 1) * per : (2 * i + 2) * per].view(shape)
                self.kv_caches.append((k, v))

    def close(self) -> None:
        self.kv_caches = []
        for seg in self.segments:
            seg.close()
        self.segments = []
