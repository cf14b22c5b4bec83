"""A listening socket that serves each connection on a thread of its own, and the status
byte its answers start with: the owner side of the ``tcp`` and collective backends
(``TcpServer``, ``CollectiveServer``)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from contextlib import suppress

from store.kv_store_errors import TransferError

SOCK_BUF = 4 << 20


def tune(sock: socket.socket) -> None:
    """No Nagle delay, large buffers: KV moves in bulk."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the peer closes first."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def read_status(sock: socket.socket) -> None:
    """Read one status byte; a refusal raises ``TransferError`` with the owner's message."""
    status = bytearray(1)
    recv_exact(sock, memoryview(status))
    if status[0] != 0:
        size = bytearray(4)
        recv_exact(sock, memoryview(size))
        msg = bytearray(struct.unpack("<I", size)[0])
        recv_exact(sock, memoryview(msg))
        raise TransferError(f"remote refused the transfer: {msg.decode(errors='replace')}")


def refusal(message: str) -> bytes:
    """A refusal on the wire: status 1, then the message's length and bytes."""
    data = message.encode()
    return b"\x01" + struct.pack("<I", len(data)) + data


class SocketServer:
    """Accepts on ``host:port`` (0: any free port) and runs ``handle(conn)`` on a thread per
    connection, closing the connection when it returns. ``close`` stops accepting and shuts
    every open connection down (their ``handle`` then sees an ``OSError``)."""

    def __init__(
        self, host: str, port: int, handle: Callable[[socket.socket], None], name: str
    ) -> None:
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._handle = handle
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=name, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        with suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
