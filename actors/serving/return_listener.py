"""The ingress's end of the direct way back (``actors.engine.direct_return``): one listening
socket that replicas connect to and write frames of ``ReturnEntry`` on.

    listener = ReturnListener(host, deliver)    # deliver(entry), on the event loop
    address = await listener.address()          # started on first use; in StartPrompt
    listener.close()

A connection is read only after it presented the listener's token; each frame is read
whole, and its entries are handed on in order. A connection that breaks (its replica
died, or cut a frame) is dropped: what the replica could not send it reports to its
Conductor, which fails the request through the replica's event channel, so nothing here
waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import uuid
from collections.abc import Callable

from actors.engine.direct_return import FRAME_LENGTH, TOKEN_BYTES, ReturnAddress, ReturnEntry

log = logging.getLogger(__name__)
TOKEN_TIMEOUT_S = 30.0


class ReturnListener:
    def __init__(self, host: str, deliver: Callable[[ReturnEntry], None]) -> None:
        self.host = host
        self.deliver = deliver
        self.token = uuid.uuid4().hex.encode()
        assert len(self.token) == TOKEN_BYTES
        self._server: asyncio.Server | None = None
        self._address: ReturnAddress | None = None
        self._starting: asyncio.Lock | None = None
        self._readers: set[asyncio.Task[None]] = set()

    async def address(self) -> ReturnAddress:
        if self._address is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self._address is None:
                    self._server = await asyncio.start_server(self._connected, self.host, 0)
                    port = int(self._server.sockets[0].getsockname()[1])
                    self._address = ReturnAddress(self.host, port, self.token)
        return self._address

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._readers.add(task)
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), TOKEN_TIMEOUT_S)
            if token != self.token:
                return
            while True:
                (size,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
                entries: list[ReturnEntry] = pickle.loads(await reader.readexactly(size))
                for entry in entries:
                    self.deliver(entry)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the replica closed it, died, or never presented the token
        except Exception:  # a bug in a frame: drop this connection, keep the ingress
            log.exception("a direct event connection failed")
        finally:
            writer.close()
            if task is not None:
                self._readers.discard(task)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._readers):
            with contextlib.suppress(RuntimeError):
                task.cancel()
