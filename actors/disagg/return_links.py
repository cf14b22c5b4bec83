"""A decode replica's way back to the ingresses (``actors.engine.direct_return``): the
route of each request the Conductor placed here with one, and one connection per ingress.

Only the replica's loop thread calls it. After each step ``send`` writes, per ingress, one
frame with the step's events of every request routed there (its ``Delta``, and its
``Done`` when it finished), before the replica tells the Conductor that a request ended:
the Conductor never sees a request's end before its ingress could have its last tokens.
A write that fails (the ingress is gone, or did not take a frame within ``SEND_TIMEOUT_S``)
closes that connection and returns every request routed there: events of theirs may be
lost, so they run no further here (the replica ends each as aborted, which its ingress
hears from the Conductor as a retriable failure). A request whose events never went out
yet (still reserved) keeps its route and connects again when it has some.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket

from actors.engine.direct_return import ReturnAddress, ReturnEntry, ReturnRoute, encode
from actors.engine.events import Delta, Done, Event
from actors.engine.outputs import RequestOutput, StreamDelta

SEND_TIMEOUT_S = 10.0  # a connect or a frame's write; past it, the ingress counts as gone


class ReturnLinks:
    def __init__(self, timeout: float = SEND_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.routes: dict[str, ReturnRoute] = {}  # request key -> where its events go
        self._socks: dict[ReturnAddress, socket.socket] = {}

    def add(self, key: str, route: ReturnRoute) -> None:
        self.routes[key] = route

    def drop(self, key: str) -> None:
        self.routes.pop(key, None)

    def routed(self, key: str) -> bool:
        return key in self.routes

    def send(self, deltas: list[StreamDelta], ends: dict[str, RequestOutput]) -> set[str]:
        """Write the routed ``deltas`` (and the ``Done`` of each routed request ``ends``
        holds the output of) to their ingresses; returns the keys of every request routed
        to an ingress that could not be written to."""
        frames: dict[ReturnAddress, list[ReturnEntry]] = {}
        for d in deltas:
            route = self.routes.get(d.request_id)
            if route is None:
                continue
            mine = dataclasses.replace(d, request_id=route.request_id)  # the ingress's id
            events: list[Event] = [Delta(route.index, mine)]
            out = ends.get(d.request_id)
            if out is not None:
                done = dataclasses.replace(out, request_id=route.request_id)
                events.append(Done(route.index, done))
            entry = ReturnEntry(route.prompt, route.index, route.attempt, events)
            frames.setdefault(route.address, []).append(entry)
        lost: set[str] = set()
        for address, entries in frames.items():
            if not self._write(address, encode(entries)):
                lost |= {k for k, r in self.routes.items() if r.address == address}
        return lost

    def _write(self, address: ReturnAddress, data: bytes) -> bool:
        sock = self._socks.get(address)
        try:
            if sock is None:
                sock = socket.create_connection((address.host, address.port), self.timeout)
                self._socks[address] = sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one frame a step
                sock.sendall(address.token)
            sock.sendall(data)
            return True
        except OSError:
            self._close(address)
            return False

    def _close(self, address: ReturnAddress) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        for address in list(self._socks):
            self._close(address)
