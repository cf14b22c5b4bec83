"""The KV transfer layer: move KV bytes between endpoints, off the control path.

    from store.transfer import Endpoint, TransferEngine
    engine = TransferEngine("worker-3", node_id)             # a worker that pulls/pushes
    engine.read(shard_endpoint, [(offset, local_view), ...])  # one memcpy on one node
    engine.write(shard_endpoint, [(offset, local_view), ...])

    pool = engine.register(kv_pool)                           # once; then integer ranges:
    engine.read_ranges(shard_endpoint, pool, [(remote_off, local_off, nbytes), ...])
    engine.write_ranges(shard_endpoint, pool, ranges)

``ops`` check one local buffer object per op (up to a microsecond each); ``ranges`` of
registered ``LocalMemory`` are integer arithmetic, which is what the runtime's KV moves
(store loads and stores, prefill -> decode streaming) use. Both merge contiguous runs.

Backends (``backend.py``): ``shm`` (same node), ``tcp`` (across nodes), ``nixl`` (UCX),
``gloo``/``nccl`` (paired sends and receives in a 2-rank torch.distributed group; NCCL has
not run), and a slot for ``mooncake``.
"""

from store.transfer.backend import (
    TransferBackend,
    backend_names,
    create_backend,
    register_backend,
)
from store.transfer.endpoint import CopyOps, Endpoint, LocalMemory, Ranges
from store.transfer.engine import TransferEngine

__all__ = [
    "CopyOps",
    "Endpoint",
    "LocalMemory",
    "Ranges",
    "TransferBackend",
    "TransferEngine",
    "backend_names",
    "create_backend",
    "register_backend",
]
