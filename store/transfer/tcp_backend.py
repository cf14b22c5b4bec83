"""Cross-node transfers over plain TCP: a server thread next to a segment, and a client.

``TcpServer(buffer, host, port)`` serves reads and writes of byte ranges of ``buffer`` (a
shard's DRAM segment) from a background thread per connection. ``TcpBackend`` is the client
side of the ``TransferBackend`` interface (``read``/``write`` of ops and
``read_ranges``/``write_ranges`` of registered ``LocalMemory``, both sent as the same merged
copies); it keeps one connection per remote address.

Wire format (little-endian), per connection:
    client -> server: token (32 ASCII bytes) once, checked before anything else
    request:  u8 op (1 read, 2 write) | u64 offset | u64 nbytes  [| nbytes payload if write]
    reply:    u8 status (0 ok) [| nbytes payload if read]
              or status 1 | u32 len | message, and the server closes the connection
Reads are pipelined in batches (``BATCH`` headers out, then the replies), writes stream
header+payload and collect the status bytes after each batch. Payloads go straight from the
socket into the destination (``recv_into``) and from the source view to the socket.

The server copies into and out of ranges the shard reserved or pinned; its threads touch
only bytes, never the shard's metadata. Anyone holding the endpoint's token can read and
write the segment: keep the port inside the cluster network.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import threading
from contextlib import suppress

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
from store.transfer.socket_server import SocketServer, read_status, recv_exact, refusal, tune

REQUEST = struct.Struct("<BQQ")
READ, WRITE = 1, 2
TOKEN_LEN = 32
BATCH = 64


class TcpServer:
    """Serves ``buffer`` (flat uint8) to clients that present ``token``."""

    def __init__(
        self, buffer: np.ndarray, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        if buffer.dtype != np.uint8 or buffer.ndim != 1:
            raise ValueError("TcpServer serves a flat uint8 buffer")
        self.buffer = buffer
        self.token = token or secrets.token_hex(TOKEN_LEN // 2)
        if len(self.token) != TOKEN_LEN:
            raise ValueError(f"token must be {TOKEN_LEN} characters")
        self._server = SocketServer(host, port, self._serve, "kv-tcp-accept")
        self.host, self.port = self._server.host, self._server.port

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        try:
            token = bytearray(TOKEN_LEN)
            recv_exact(conn, memoryview(token))
            if not hmac.compare_digest(bytes(token), self.token.encode()):
                self._fail(conn, "bad token")
                return
            while True:
                recv_exact(conn, memoryview(head))
                op, offset, nbytes = REQUEST.unpack(head)
                if op not in (READ, WRITE) or offset + nbytes > self.buffer.size:
                    self._fail(conn, f"bad request op={op} range=[{offset}, {offset + nbytes})")
                    return
                view = self.buffer[offset : offset + nbytes].data
                if op == WRITE:
                    recv_exact(conn, view)
                    conn.sendall(b"\x00")
                else:
                    conn.sendall(b"\x00")
                    conn.sendall(view)
        except (ConnectionError, OSError):
            pass

    @staticmethod
    def _fail(conn: socket.socket, message: str) -> None:
        with suppress(OSError):
            conn.sendall(refusal(message))

    def close(self) -> None:
        self._server.close()


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()  # one op stream per connection at a time

    def _connect(self, remote: Endpoint) -> socket.socket:
        addr = remote.tcp_address
        if addr is None:
            raise BackendUnavailableError(
                f"endpoint {remote.endpoint_id!r} serves no TCP address; start its engine "
                "with serve_tcp=True"
            )
        sock = self._conns.get(addr)
        if sock is None:
            try:
                sock = socket.create_connection(addr, timeout=self.timeout_s)
            except OSError as e:
                raise TransferError(f"cannot reach {remote.endpoint_id!r} at {addr}: {e}") from e
            tune(sock)
            sock.sendall(remote.token.encode().ljust(TOKEN_LEN, b"\x00")[:TOKEN_LEN])
            self._conns[addr] = sock
        return sock

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        norm = normalize_ops(ops, remote.segment_bytes, writable=True)
        return self._run(remote, norm, READ)

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        norm = normalize_ops(ops, remote.segment_bytes, writable=False)
        return self._run(remote, norm, WRITE)

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        norm = normalize_ranges(local, ranges, remote.segment_bytes, writable=True)
        return self._run(remote, norm, READ)

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        norm = normalize_ranges(local, ranges, remote.segment_bytes, writable=False)
        return self._run(remote, norm, WRITE)

    def _run(self, remote: Endpoint, ops: Copies, op: int) -> int:
        with self._lock:
            sock = self._connect(remote)
            try:
                for start in range(0, len(ops), BATCH):
                    batch = ops[start : start + BATCH]
                    if op == READ:
                        sock.sendall(b"".join(REQUEST.pack(READ, o, b.size) for o, b in batch))
                        for _, buf in batch:
                            read_status(sock)
                            recv_exact(sock, buf.data)
                    else:
                        for o, buf in batch:
                            sock.sendall(REQUEST.pack(WRITE, o, buf.size))
                            sock.sendall(buf.data)
                        for _ in batch:
                            read_status(sock)
            except (OSError, ConnectionError, TransferError) as e:
                self._drop(remote)
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"transfer with {remote.endpoint_id!r} failed: {e}") from e
        return sum(b.size for _, b in ops)

    def _drop(self, remote: Endpoint) -> None:
        addr = remote.tcp_address
        sock = self._conns.pop(addr, None) if addr else None
        if sock is not None:
            sock.close()

    def forget(self, remote: Endpoint) -> None:
        with self._lock:
            self._drop(remote)

    def close(self) -> None:
        with self._lock:
            for sock in self._conns.values():
                sock.close()
            self._conns.clear()
