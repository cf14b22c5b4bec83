"""The transfer-backend interface and the registry that picks one by name, lazily.

Every backend moves bytes between local memory and byte ranges of a remote endpoint's
segment (see ``endpoint.py``): ``read(remote, ops)`` / ``write(remote, ops)`` with one local
buffer per op, and ``read_ranges(remote, local, ranges)`` / ``write_ranges(...)`` with
``(remote offset, local offset, nbytes)`` ranges of registered ``LocalMemory``. Each returns
the bytes moved and either finishes every op or raises ``TransferError``. A backend that
implements only ``read``/``write`` gets ranges through them (one op per merged range).
Backends are imported only when first asked for, so a GPU backend's package is needed only
where it runs.

    shm       same node: one memcpy between shared-memory mappings
    tcp       across nodes: plain sockets to the remote's TcpServer
    gloo      a 2-rank torch.distributed group per pair, CPU tensors (the tested form of nccl)
    nccl      the same code on CUDA tensors, one GPU per process (has not run)
    mooncake  Mooncake transfer engine, RDMA (slot)
    nixl      NVIDIA NIXL over UCX (RDMA on a cluster); used across nodes when installed
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from policies.registry import Lazy, Registry
from store.kv_store_errors import BackendUnavailableError
from store.transfer.endpoint import CopyOps, Endpoint, LocalMemory, Ranges, normalize_ranges


class TransferBackend(ABC):
    name: ClassVar[str]

    @classmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process (its package imports)."""
        return True

    @abstractmethod
    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        """local buffers <- remote ranges; returns bytes moved."""

    @abstractmethod
    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        """remote ranges <- local buffers; returns bytes moved."""

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        """``local`` bytes <- remote bytes, per ``(remote offset, local offset, nbytes)``."""
        return self.read(remote, normalize_ranges(local, ranges, remote.segment_bytes, True))

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        """remote bytes <- ``local`` bytes, per ``(remote offset, local offset, nbytes)``."""
        return self.write(remote, normalize_ranges(local, ranges, remote.segment_bytes, False))

    def forget(self, remote: Endpoint) -> None:  # noqa: B027 - optional hook
        """Drop cached mappings/connections to ``remote`` (it died or moved)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release every mapping and connection."""


# name -> backend class, imported when first asked for.
TRANSFER_BACKENDS: Registry[type[TransferBackend]] = Registry(
    "transfer backend", error=BackendUnavailableError
)
for _name, _module, _cls in (
    ("shm", "store.transfer.shm_backend", "ShmBackend"),
    ("tcp", "store.transfer.tcp_backend", "TcpBackend"),
    ("gloo", "store.transfer.collective_backend", "GlooBackend"),
    ("nccl", "store.transfer.collective_backend", "NcclBackend"),
    ("mooncake", "store.transfer.gpu_backends", "MooncakeBackend"),
    ("nixl", "store.transfer.nixl_backend", "NixlBackend"),
):
    TRANSFER_BACKENDS.add(_name, Lazy(_module, _cls))


def backend_names() -> list[str]:
    return list(TRANSFER_BACKENDS)


def register_backend(name: str, target: str) -> None:
    """Add or replace a backend: ``target`` is ``"package.module:ClassName"``."""
    module, sep, cls = target.partition(":")
    if not sep:
        raise ValueError("target must look like 'package.module:ClassName'")
    TRANSFER_BACKENDS.add(name, Lazy(module, cls), replace=True)


def backend_class(name: str) -> type[TransferBackend]:
    return TRANSFER_BACKENDS.get(name)


def create_backend(name: str, **kwargs: object) -> TransferBackend:
    """An instance of backend ``name``; raises BackendUnavailableError if it cannot run."""
    return backend_class(name)(**kwargs)
