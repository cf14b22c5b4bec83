"""Slots for GPU-cluster backends: Mooncake's transfer engine (NIXL is wired:
``nixl_backend.py``; NCCL, and gloo on CPU, are ``collective_backend.py``).

Each is registered under its name so a deployment config can ask for it; constructing one
checks its package first and raises ``BackendUnavailableError`` saying what to install, or,
when the package is present, that the slot still has to be wired. Wiring one means
implementing ``read``/``write`` of ``(remote offset, local buffer)`` ops and
``read_ranges``/``write_ranges`` of ``(remote offset, local offset, nbytes)`` ranges of a
registered ``LocalMemory`` against the remote endpoint's registered memory (Mooncake:
``TransferEngine.register_memory`` on the shard's segment and on the local memory, then
``batch_transfer_sync_read``/``batch_transfer_sync_write``). The same-node ``shm`` and
cross-node ``tcp`` backends need nothing beyond the standard library.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

from store.kv_store_errors import BackendUnavailableError
from store.transfer.backend import TransferBackend
from store.transfer.endpoint import CopyOps, Endpoint, LocalMemory, Ranges


class _SlotBackend(TransferBackend):
    package: ClassVar[str]
    install_hint: ClassVar[str]

    @classmethod
    def available(cls) -> bool:
        try:
            return importlib.util.find_spec(cls.package) is not None
        except (ImportError, ValueError):
            return False

    def __init__(self, **_: object) -> None:
        if not self.available():
            raise BackendUnavailableError(
                f"transfer backend {self.name!r} needs the {self.package!r} package "
                f"({self.install_hint}), which is not installed in this environment; use "
                "'shm' between processes on one node or 'tcp' across nodes"
            )
        raise BackendUnavailableError(
            f"transfer backend {self.name!r}: {self.package!r} is installed but this slot is "
            "not wired yet (see store/transfer/gpu_backends.py); use 'shm' or 'tcp'"
        )

    def read(self, remote: Endpoint, ops: CopyOps) -> int:  # pragma: no cover - never built
        raise BackendUnavailableError(f"{self.name} backend is a slot")

    def write(self, remote: Endpoint, ops: CopyOps) -> int:  # pragma: no cover
        raise BackendUnavailableError(f"{self.name} backend is a slot")

    def read_ranges(  # pragma: no cover - never built
        self, remote: Endpoint, local: LocalMemory, ranges: Ranges
    ) -> int:
        raise BackendUnavailableError(f"{self.name} backend is a slot")

    def write_ranges(  # pragma: no cover
        self, remote: Endpoint, local: LocalMemory, ranges: Ranges
    ) -> int:
        raise BackendUnavailableError(f"{self.name} backend is a slot")


class MooncakeBackend(_SlotBackend):
    name = "mooncake"
    package = "mooncake"
    install_hint = "pip package mooncake-transfer-engine; needs the CUDA driver and RDMA NICs"
