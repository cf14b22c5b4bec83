"""The NIXL transfer backend: one-sided reads and writes between registered memory of two
processes through NIXL (the transfer library vLLM, SGLang, Dynamo and Ray Serve LLM use),
over its UCX backend (RDMA NICs on a cluster; on one CPU host, UCX's shared-memory and TCP
transports).

- Owner side (``NixlServer``): an agent that registers the owner's segment; the segment's
  ``Endpoint`` carries the agent's metadata and the segment's address in the owner's
  process (``nixl_meta``, ``nixl_base``), so a peer needs nothing else.
- Peer side (``NixlBackend``): one agent per backend; it adds each remote agent once,
  registers each local buffer once (by address and size: buffers must outlive the
  backend, as KV caches and pools do), and moves one call's merged copies as one NIXL
  transfer, waiting until it is done. A failed transfer raises ``TransferError``.

NIXL's pip metadata pulls CUDA wheels; on a CPU host it installs with
``pip install --no-deps nixl-cu12 numpy``. Without it, asking for this backend raises
``BackendUnavailableError`` and the engine keeps using TCP across nodes.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from types import ModuleType
from typing import Any

import numpy as np

from store.kv_store_errors import BackendUnavailableError, TransferError
from store.transfer.backend import TransferBackend
from store.transfer.endpoint import (
    Copies,
    CopyOps,
    Endpoint,
    LocalMemory,
    Ranges,
    normalize_ops,
    normalize_ranges,
)

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
TIMEOUT_S = 60.0


def nixl_api() -> ModuleType | None:
    """NIXL's Python API module, or None when no NIXL package imports here."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except Exception:  # absent, or a CUDA variant that cannot load here
            continue
    return None


def _agent(api: ModuleType, prefix: str, progress_thread: bool) -> Any:
    """An agent on UCX. Over CPU transports the owner of registered memory needs UCX's
    progress thread to serve one-sided reads and writes, and NIXL's Python API runs that
    thread with no pause between polls: about half a core while idle. A peer has none; it
    progresses its own transfers while it polls their state."""
    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    return api.nixl_agent(name, config)


class NixlServer:
    """The owner's agent: registers ``buffer`` (flat uint8) for peers to read and write."""

    def __init__(self, buffer: np.ndarray, endpoint_id: str) -> None:
        api = nixl_api()
        if api is None:
            raise BackendUnavailableError(
                "serving a segment over NIXL needs the nixl package (on CPU: pip install "
                "--no-deps nixl-cu12 numpy); serve it over TCP instead"
            )
        self.agent = _agent(api, f"owner-{endpoint_id}", progress_thread=True)
        self.base = int(buffer.ctypes.data)
        descs = self.agent.get_reg_descs([(self.base, int(buffer.nbytes), 0, "")], "DRAM")
        self._reg = self.agent.register_memory(descs)
        self.metadata: bytes = self.agent.get_agent_metadata()

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


class NixlBackend(TransferBackend):
    name = "nixl"

    @classmethod
    def available(cls) -> bool:
        return nixl_api() is not None

    def __init__(self, **_: object) -> None:
        api = nixl_api()
        if api is None:
            raise BackendUnavailableError(
                "transfer backend 'nixl' needs the nixl package (on CPU: pip install "
                "--no-deps nixl-cu12 numpy), which is not installed in this environment; use "
                "'shm' between processes on one node or 'tcp' across nodes"
            )
        self.agent = _agent(api, "peer", progress_thread=False)
        self._remotes: dict[str, str] = {}  # endpoint id -> remote agent name
        self._regs: dict[tuple[int, int], Any] = {}  # (address, nbytes) -> registration

    def _remote(self, remote: Endpoint) -> str:
        name = self._remotes.get(remote.endpoint_id)
        if name is None:
            if remote.nixl_meta is None:
                raise TransferError(f"endpoint {remote.endpoint_id!r} does not serve NIXL")
            got = self.agent.add_remote_agent(remote.nixl_meta)
            name = got.decode() if isinstance(got, bytes) else str(got)
            self._remotes[remote.endpoint_id] = name
        return name

    def _register(self, views: list[np.ndarray]) -> None:
        for v in views:
            key = (int(v.ctypes.data), int(v.nbytes))
            if key not in self._regs and v.nbytes:
                descs = self.agent.get_reg_descs([(key[0], key[1], 0, "")], "DRAM")
                self._regs[key] = self.agent.register_memory(descs)

    def _move(self, op: str, remote: Endpoint, copies: Copies) -> int:
        if not copies:
            return 0
        name = self._remote(remote)
        local = [(int(v.ctypes.data), int(v.nbytes), 0) for _, v in copies]
        far = [(remote.nixl_base + off, int(v.nbytes), 0) for off, v in copies]
        handle = self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(far, "DRAM"),
            name,
        )
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + TIMEOUT_S
            while state != "DONE":
                if state == "ERR" or time.monotonic() > deadline:
                    raise TransferError(
                        f"NIXL {op} with endpoint {remote.endpoint_id!r} failed ({state})"
                    )
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)
        return sum(n for _, n, _ in local)

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        copies = normalize_ops(ops, remote.segment_bytes, True)
        self._register([v for _, v in copies])
        return self._move("READ", remote, copies)

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        copies = normalize_ops(ops, remote.segment_bytes, False)
        self._register([v for _, v in copies])
        return self._move("WRITE", remote, copies)

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        self._register(local.views)
        return self._move(
            "READ", remote, normalize_ranges(local, ranges, remote.segment_bytes, True)
        )

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        self._register(local.views)
        copies = normalize_ranges(local, ranges, remote.segment_bytes, False)
        return self._move("WRITE", remote, copies)

    def forget(self, remote: Endpoint) -> None:
        name = self._remotes.pop(remote.endpoint_id, None)
        if name is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # already gone
                pass

    def close(self) -> None:
        for endpoint_id in list(self._remotes):
            self.forget(Endpoint(endpoint_id, "?"))
        for reg in self._regs.values():
            self.agent.deregister_memory(reg)
        self._regs.clear()
