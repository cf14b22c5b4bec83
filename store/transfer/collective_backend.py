"""Transfers through a 2-rank torch.distributed process group: gloo on CPU tensors, NCCL on
CUDA tensors. One implementation; the group's backend (and so its device) is a parameter.

Sends and receives are two-sided, so, as with ``tcp``, the segment's owner serves:

- Owner side (``CollectiveServer(segment, "gloo" | "nccl", host)``): a control socket and a
  ``TCPStore`` for rendezvous; its ``address`` travels in the owner's ``Endpoint``
  (``collective``). One thread per caller answers that caller's requests and performs the
  owner's half of every copy.
- Caller side (``GlooBackend`` / ``NcclBackend``: ``CollectiveBackend`` with the group's
  backend bound): one control connection per remote endpoint and, over it, one process
  group of two ranks (owner 0, caller 1) built directly on a ``PrefixStore`` of the owner's
  store. No global ``init_process_group``: these groups live beside a worker's TP/KVP
  groups and never touch them.

Control protocol (little-endian), per connection:
    caller -> owner  token (32 ASCII bytes), once
    owner -> caller  u8 0 | u32 store port | 16-byte pair key; both then build the group on
                     PrefixStore(pair key, store)   (bad token: a refusal, then close)
    per call:
    caller -> owner  u8 op (1 read, 2 write) | u32 count | count x (u64 offset, u64 nbytes)
    owner -> caller  u8 0 (accepted), or a refusal: u8 1 | u32 len | message (nothing was
                     posted; the connection stays usable)
    both             copy i is one send/recv with tag i (read: the owner sends)
    owner -> caller  u8 0 once every copy finished on the owner's side (a write landed)
Every wait (socket, store, each send and recv) has the backend's timeout; a failure drops the
connection and its group and raises ``TransferError``.

Memory on both sides is host memory (``LocalMemory`` views; a segment may also be a tensor
on the group's device). On gloo the bytes are sent from and received into it directly; on
NCCL a host buffer goes through a staging copy on the device, and a segment already on the
GPU does not. The NCCL path needs a GPU per process (NCCL refuses two ranks on one device)
and has never run; the gloo path is the tested one (``tests/unit/test_transfer_collective.py``).
Anyone holding the token can read and write the segment, and the store takes no token:
keep both ports inside the cluster network.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore

from store.devices import with_index
from store.kv_store_errors import BackendUnavailableError, KVStoreError, TransferError
from store.transfer.backend import TransferBackend
from store.transfer.endpoint import (
    CollectiveAddress,
    Copies,
    CopyOps,
    Endpoint,
    LocalMemory,
    Ranges,
    normalize_ops,
    normalize_ranges,
)
from store.transfer.socket_server import SocketServer, read_status, recv_exact, refusal, tune
from store.transfer.tcp_backend import TOKEN_LEN

READ, WRITE = 1, 2
HELLO = struct.Struct("<I16s")  # after status 0: store port, pair key
CALL = struct.Struct("<BI")  # op, number of copies
COPY = struct.Struct("<QQ")  # remote offset, nbytes
MAX_COPIES = 1 << 20  # per call: a 16 MiB header at most
OWNER, CALLER = 0, 1  # ranks in each pair's group
TIMEOUT_S = 30.0


def group_available(kind: str) -> bool:
    """Whether a ``kind`` ("gloo" or "nccl") group can be built in this process."""
    if not dist.is_available():
        return False
    if kind == "gloo":
        return bool(dist.is_gloo_available())
    return bool(torch.cuda.is_available() and dist.is_nccl_available())


def group_device(kind: str, device: str | torch.device | None) -> torch.device:
    """The device a ``kind`` group moves tensors on: the CPU for gloo, a GPU for NCCL."""
    if kind not in ("gloo", "nccl"):
        raise ValueError(f"a collective transfer group is 'gloo' or 'nccl', not {kind!r}")
    if not group_available(kind):
        raise BackendUnavailableError(
            "transfer backend 'nccl' needs a CUDA build of torch with NCCL and a visible "
            "GPU; none here. Use 'shm' between processes on one node, 'tcp' across nodes, "
            "or 'gloo' for the same collective path on CPU"
            if kind == "nccl"
            else "transfer backend 'gloo' needs torch.distributed with gloo, not built here"
        )
    if kind == "gloo":
        return torch.device("cpu")
    # with its index, so that a tensor already there compares equal and is not staged
    return with_index(device if device is not None else "cuda")


def _group(kind: str, store: Store, rank: int, local_host: str, timeout: timedelta) -> Any:
    """A 2-rank group of ``kind`` on ``store``; gloo listens on ``local_host`` (the address
    of this side of the control connection, which reaches the peer)."""
    if kind == "gloo":
        from torch.distributed import ProcessGroupGloo

        # options through the binding's _Options (torch's .pyi lags it): only they take a
        # device, and the default device is whatever the hostname resolves to
        gloo_opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        gloo_opts._timeout = timeout
        return ProcessGroupGloo(store, rank, 2, gloo_opts)
    from torch.distributed import ProcessGroupNCCL  # only in CUDA builds

    nccl_opts = ProcessGroupNCCL.Options()
    nccl_opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, 2, nccl_opts)


def _close_group(group: Any) -> None:
    """Fail the group's pending sends and receives and release it."""
    if group is not None:
        with suppress(RuntimeError):
            group.abort()


def _move(
    group: Any,
    peer: int,
    device: torch.device,
    sending: bool,
    buffers: Sequence[torch.Tensor],
    timeout: timedelta,
) -> None:
    """Send (``sending``) or receive every flat uint8 ``buffers[i]`` with tag ``i``; returns
    once each finished here. A buffer off ``device`` goes through a staging copy on it."""
    staged = [b if b.device == device else _staging(b, device, sending) for b in buffers]
    post = group.send if sending else group.recv
    works = [post([t], peer, i) for i, t in enumerate(staged)]
    for work in works:
        work.wait(timeout)
    if not sending:
        for b, t in zip(buffers, staged, strict=True):
            if t is not b:
                b.copy_(t)


def _staging(buffer: torch.Tensor, device: torch.device, sending: bool) -> torch.Tensor:
    """``buffer``'s bytes on ``device`` (to send), or room for them there (to receive)."""
    return buffer.to(device) if sending else torch.empty_like(buffer, device=device)


def _host_tensor(view: np.ndarray) -> torch.Tensor:
    """A tensor over ``view``'s bytes; torch wraps only writable memory, so a read-only
    source (bytes) is copied once."""
    return torch.from_numpy(view if view.flags.writeable else view.copy())


class CollectiveServer:
    """Serves ``segment`` (flat uint8: a numpy array, or a tensor on the group's device) to
    callers that present the token, through ``kind`` ("gloo" or "nccl") groups."""

    def __init__(
        self,
        segment: np.ndarray | torch.Tensor,
        kind: str = "gloo",
        host: str = "127.0.0.1",
        *,
        device: str | torch.device | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.kind = kind
        self.device = group_device(kind, device)
        tensor = torch.from_numpy(segment) if isinstance(segment, np.ndarray) else segment
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("CollectiveServer serves a flat, contiguous uint8 buffer")
        self.segment = tensor
        self.timeout = timedelta(seconds=timeout_s)
        self.token = secrets.token_hex(TOKEN_LEN // 2)
        self._store: TCPStore | None = TCPStore(
            host, 0, None, True, self.timeout, wait_for_workers=False
        )
        self._server = SocketServer(host, 0, self._serve, "kv-coll-accept")
        self.host, self.port = self._server.host, self._server.port
        self.address = CollectiveAddress(self.host, self.port, self.token, kind)

    def _serve(self, conn: socket.socket) -> None:
        group = None
        timeout_s = self.timeout.total_seconds()
        try:
            conn.settimeout(timeout_s)
            token = bytearray(TOKEN_LEN)
            recv_exact(conn, memoryview(token))
            if not hmac.compare_digest(bytes(token), self.token.encode()):
                conn.sendall(refusal("bad token"))
                return
            key = secrets.token_hex(8)
            conn.sendall(b"\x00" + HELLO.pack(self._store_port(), key.encode()))
            local = conn.getsockname()[0]
            # a store client of its own: one client's blocking wait holds its connection
            store = TCPStore(local, self._store_port(), None, False, self.timeout)
            group = _group(self.kind, PrefixStore(key, store), OWNER, local, self.timeout)
            head = bytearray(CALL.size)
            while True:
                conn.settimeout(None)  # a caller may stay idle between calls
                recv_exact(conn, memoryview(head))
                conn.settimeout(timeout_s)
                op, count = CALL.unpack(head)
                if count > MAX_COPIES:  # its ranges are not read: the stream is lost
                    conn.sendall(refusal(f"{count} copies in one call, over {MAX_COPIES}"))
                    return
                body = bytearray(COPY.size * count)
                recv_exact(conn, memoryview(body))
                copies = [COPY.unpack_from(body, i * COPY.size) for i in range(count)]
                problem = self._check(op, copies)
                if problem:
                    conn.sendall(refusal(problem))
                    continue
                conn.sendall(b"\x00")
                views = [self.segment[o : o + n] for o, n in copies]
                _move(group, CALLER, self.device, op == READ, views, self.timeout)
                conn.sendall(b"\x00")
        except (OSError, ConnectionError, RuntimeError):
            pass  # the caller left or failed: it sees a closed connection
        finally:
            _close_group(group)

    def _store_port(self) -> int:
        if self._store is None:
            raise ConnectionError("the collective server is closed")
        return int(self._store.port)

    def _check(self, op: int, copies: list[tuple[int, int]]) -> str:
        """Why a call cannot run (empty when it can): a bad op or a range off the segment."""
        if op not in (READ, WRITE):
            return f"bad op {op}"
        size = self.segment.numel()
        for o, n in copies:
            if o + n > size:
                return f"range [{o}, {o + n}) lies outside the segment of {size} bytes"
        return ""

    def close(self) -> None:
        """Stop serving; callers' next transfers fail with ``TransferError``."""
        self._server.close()
        self._store = None


@dataclass
class _Pair:
    """The caller's connection to one owner: its control socket, store client and group."""

    sock: socket.socket
    store: TCPStore  # kept open: NCCL builds its communicator through it at the first copy
    group: Any


class CollectiveBackend(TransferBackend):
    """The caller's side; subclasses bind ``kind`` ("gloo" or "nccl")."""

    kind: ClassVar[str]

    @classmethod
    def available(cls) -> bool:
        return group_available(cls.kind)

    def __init__(
        self, timeout_s: float = TIMEOUT_S, device: str | torch.device | None = None
    ) -> None:
        self.device = group_device(self.kind, device)
        self.timeout = timedelta(seconds=timeout_s)
        self._pairs: dict[str, _Pair] = {}  # remote endpoint id -> its pair
        self._lock = threading.Lock()  # one call per backend at a time

    def _pair(self, remote: Endpoint) -> _Pair:
        pair = self._pairs.get(remote.endpoint_id)
        if pair is not None:
            return pair
        addr = remote.collective
        if addr is None or addr.kind != self.kind:
            raise BackendUnavailableError(
                f"endpoint {remote.endpoint_id!r} serves no {self.kind!r} collective address; "
                f"start its engine with serve_collective={self.kind!r}"
            )
        timeout_s = self.timeout.total_seconds()
        sock = socket.create_connection((addr.host, addr.port), timeout=timeout_s)
        try:
            tune(sock)
            sock.sendall(addr.token.encode().ljust(TOKEN_LEN, b"\x00")[:TOKEN_LEN])
            read_status(sock)
            hello = bytearray(HELLO.size)
            recv_exact(sock, memoryview(hello))
            store_port, key = HELLO.unpack(hello)
            store = TCPStore(addr.host, store_port, None, False, self.timeout)
            local = sock.getsockname()[0]
            group = _group(self.kind, PrefixStore(key.decode(), store), CALLER, local, self.timeout)
        except BaseException:
            sock.close()
            raise
        pair = self._pairs[remote.endpoint_id] = _Pair(sock, store, group)
        return pair

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        return self._run(remote, normalize_ops(ops, remote.segment_bytes, True), READ)

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        return self._run(remote, normalize_ops(ops, remote.segment_bytes, False), WRITE)

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        copies = normalize_ranges(local, ranges, remote.segment_bytes, True)
        return self._run(remote, copies, READ)

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        copies = normalize_ranges(local, ranges, remote.segment_bytes, False)
        return self._run(remote, copies, WRITE)

    def _run(self, remote: Endpoint, copies: Copies, op: int) -> int:
        if not copies:
            return 0
        if len(copies) > MAX_COPIES:
            raise TransferError(f"{len(copies)} copies in one call, over {MAX_COPIES}")
        head = CALL.pack(op, len(copies)) + b"".join(COPY.pack(o, v.size) for o, v in copies)
        with self._lock:
            try:
                pair = self._pair(remote)
                pair.sock.sendall(head)
                read_status(pair.sock)  # accepted; a refusal leaves the pair usable
                buffers = [_host_tensor(v) for _, v in copies]
                _move(pair.group, OWNER, self.device, op == WRITE, buffers, self.timeout)
                read_status(pair.sock)  # done on the owner's side
            except KVStoreError:  # a refusal (the pair stays) or no address to reach
                raise
            except (OSError, ConnectionError, RuntimeError) as e:
                self._drop(remote.endpoint_id)
                raise TransferError(
                    f"{self.kind} transfer with {remote.endpoint_id!r} failed: {e}"
                ) from e
        return sum(v.size for _, v in copies)

    def _drop(self, endpoint_id: str) -> None:
        pair = self._pairs.pop(endpoint_id, None)
        if pair is not None:
            pair.sock.close()
            _close_group(pair.group)

    def forget(self, remote: Endpoint) -> None:
        with self._lock:
            self._drop(remote.endpoint_id)

    def close(self) -> None:
        with self._lock:
            for endpoint_id in list(self._pairs):
                self._drop(endpoint_id)


class GlooBackend(CollectiveBackend):
    """The collective path on CPU tensors (what the tests run)."""

    name = "gloo"
    kind = "gloo"


class NcclBackend(CollectiveBackend):
    """The collective path on CUDA tensors, one GPU per process; has not run (needs two)."""

    name = "nccl"
    kind = "nccl"
