"""The KV transfer layer: move KV bytes between endpoints, off the control path.

    from store.transfer import Endpoint, TransferEngine
    engine = TransferEngine("worker-3", node_id)             # a worker that pulls/pushes
    engine.read(shard_endpoint, [(offset, local_view), ...])  # one memcpy on one node
    engine.write(shard_endpoint, [(offset, local_view), ...])

Backends (``backend.py``): ``shm`` (same node), ``tcp`` (across nodes), and slots for
``nccl``, ``mooncake`` and ``nixl`` on GPU clusters.
"""

from store.transfer.backend import (
    TransferBackend,
    backend_names,
    create_backend,
    register_backend,
)
from store.transfer.endpoint import CopyOps, Endpoint
from store.transfer.engine import TransferEngine

__all__ = [
    "CopyOps",
    "Endpoint",
    "TransferBackend",
    "TransferEngine",
    "backend_names",
    "create_backend",
    "register_backend",
]
