"""One endpoint's transfer engine: publishes an ``Endpoint`` and moves bytes to and from
other endpoints through the backend that fits where the two ends are.

    engine = TransferEngine(endpoint_id, node_id, segment=None, serve_tcp=False,
                            tcp_host="127.0.0.1", advertise_host=None, prefer=(),
                            serve_collective=None)
    engine.endpoint -> Endpoint              # send this on the control path
    engine.backend_for(remote) -> str        # "shm" | "tcp" | a preferred backend
    engine.read(remote, ops) -> int          # local buffers <- remote segment ranges
    engine.write(remote, ops) -> int         # remote segment ranges <- local buffers
    local = engine.register(pool)            # or register(k0, v0, k1, v1, ...): once
    engine.read_ranges(remote, local, [(remote_off, local_off, nbytes), ...]) -> int
    engine.write_ranges(remote, local, ranges) -> int
    engine.forget(remote); engine.close()

``ops`` pair each remote offset with a local buffer object, checked per op; ``ranges`` name
bytes of memory registered once by integer offsets, so a transfer of many blocks costs
integer arithmetic plus the copies (see ``endpoint.py``). The runtime's KV moves use ranges.

Choice, per remote endpoint: the first name in ``prefer`` (asking for a backend that cannot
run here raises ``BackendUnavailableError``: an explicit request is not silently dropped);
else ``shm`` when the remote is on the same node and its segment can be mapped here; else
``nixl`` when the remote serves NIXL and NIXL is installed here; else ``tcp`` when the
remote serves TCP; else a clear error. An endpoint that owns a ``segment``
serves it over TCP only with ``serve_tcp=True`` (shards do; a worker that only pulls and
pushes does not need to), and through paired sends and receives of torch.distributed groups
only with ``serve_collective="gloo"`` (CPU) or ``"nccl"`` (GPU); a peer reaches that with
``prefer=("gloo",)`` or ``("nccl",)`` (``collective_backend.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from store.kv_store_errors import BackendUnavailableError, TransferError
from store.shared_segment import DEFAULT_SHM_DIR, SharedSegment
from store.transfer.backend import TransferBackend, create_backend
from store.transfer.endpoint import CopyOps, Endpoint, LocalMemory, Ranges
from store.transfer.nixl_backend import NixlBackend, NixlServer
from store.transfer.shm_backend import ShmBackend
from store.transfer.tcp_backend import TcpServer


class TransferEngine:
    def __init__(
        self,
        endpoint_id: str,
        node_id: str,
        segment: SharedSegment | None = None,
        *,
        serve_tcp: bool = False,
        tcp_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        prefer: Sequence[str] = (),
        shm_dir: str = DEFAULT_SHM_DIR,
        serve_nixl: bool | None = None,
        serve_collective: str | None = None,
    ) -> None:
        """``serve_nixl``: also serve the segment through a NIXL agent (None: when
        ``serve_tcp`` and NIXL is installed); peers on other nodes then use NIXL.
        ``serve_collective``: also serve it to peers that prefer "gloo" or "nccl"."""
        if not endpoint_id or not node_id:
            raise ValueError("endpoint_id and node_id must be non-empty")
        if serve_tcp and segment is None:
            raise ValueError("serve_tcp=True needs a segment to serve")
        self.segment = segment
        self.prefer = tuple(prefer)
        self.shm_dir = shm_dir
        self._server = TcpServer(segment.array, host=tcp_host) if serve_tcp and segment else None
        server = self._server
        if serve_nixl is None:
            serve_nixl = serve_tcp and NixlBackend.available()
        if serve_nixl and segment is None:
            raise ValueError("serve_nixl=True needs a segment to serve")
        self._nixl = NixlServer(segment.array, endpoint_id) if serve_nixl and segment else None
        self._collective = None
        if serve_collective is not None:
            if segment is None:
                raise ValueError("serve_collective needs a segment to serve")
            # imported here: torch loads only where a collective server runs
            from store.transfer.collective_backend import CollectiveServer

            self._collective = CollectiveServer(segment.array, serve_collective, tcp_host)
        collective = self._collective.address if self._collective else None
        if collective is not None and advertise_host:
            collective = replace(collective, host=advertise_host)
        self.endpoint = Endpoint(
            endpoint_id=endpoint_id,
            node_id=node_id,
            segment_name=segment.name if segment else None,
            segment_bytes=segment.nbytes if segment else 0,
            tcp_host=(advertise_host or server.host) if server else None,
            tcp_port=server.port if server else None,
            token=server.token if server else "",
            nixl_meta=self._nixl.metadata if self._nixl else None,
            nixl_base=self._nixl.base if self._nixl else 0,
            collective=collective,
        )
        self._backends: dict[str, TransferBackend] = {}
        self._choice: dict[str, str] = {}  # remote endpoint id -> backend name
        for name in self.prefer:  # fail now, not at the first transfer
            self._backend(name)

    def _backend(self, name: str) -> TransferBackend:
        backend = self._backends.get(name)
        if backend is None:
            if name == "shm":
                backend = ShmBackend(self.shm_dir)
            else:
                backend = create_backend(name)
            self._backends[name] = backend
        return backend

    def chosen_backends(self) -> dict[str, str]:
        """Remote endpoint id -> the backend its transfers use (those reached so far)."""
        return dict(self._choice)

    def backend_for(self, remote: Endpoint) -> str:
        name = self._choice.get(remote.endpoint_id)
        if name is not None:
            return name
        if self.prefer:
            name = self.prefer[0]
        elif remote.node_id == self.endpoint.node_id and remote.segment_name is not None:
            shm = self._backend("shm")
            assert isinstance(shm, ShmBackend)
            try:
                shm.segment(remote)
                name = "shm"
            except TransferError:  # same node id but the segment is not visible here
                name = None
        if name is None and remote.nixl_meta is not None and NixlBackend.available():
            name = "nixl"
        if name is None and remote.tcp_address is not None:
            name = "tcp"
        if name is None:
            raise BackendUnavailableError(
                f"no transfer backend reaches endpoint {remote.endpoint_id!r} on node "
                f"{remote.node_id!r} from node {self.endpoint.node_id!r}: it shares no "
                "segment here and serves no TCP address"
            )
        self._choice[remote.endpoint_id] = name
        return name

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        """Copy remote segment ranges into the local buffers of ``ops``; bytes moved."""
        return self._backend(self.backend_for(remote)).read(remote, ops)

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        """Copy the local buffers of ``ops`` into remote segment ranges; bytes moved."""
        return self._backend(self.backend_for(remote)).write(remote, ops)

    @staticmethod
    def register(*buffers: object) -> LocalMemory:
        """Register local buffers once for ``read_ranges``/``write_ranges``: offsets address
        them back to back (see ``LocalMemory``)."""
        return LocalMemory(*buffers)

    def read_ranges(self, remote: Endpoint, local: LocalMemory | object, ranges: Ranges) -> int:
        """Copy remote bytes into ``local`` (registered memory, or one buffer), per
        ``(remote offset, local offset, nbytes)`` range; bytes moved."""
        backend = self._backend(self.backend_for(remote))
        return backend.read_ranges(remote, LocalMemory.of(local), ranges)

    def write_ranges(self, remote: Endpoint, local: LocalMemory | object, ranges: Ranges) -> int:
        """Copy bytes of ``local`` (registered memory, or one buffer) into the remote
        segment, per ``(remote offset, local offset, nbytes)`` range; bytes moved."""
        backend = self._backend(self.backend_for(remote))
        return backend.write_ranges(remote, LocalMemory.of(local), ranges)

    def forget(self, remote: Endpoint) -> None:
        """Drop mappings and connections to ``remote`` (call when it died)."""
        self._choice.pop(remote.endpoint_id, None)
        for backend in self._backends.values():
            backend.forget(remote)

    def close(self) -> None:
        """Close backends and the servers; the segment stays with its owner."""
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        if self._collective is not None:
            self._collective.close()
            self._collective = None
