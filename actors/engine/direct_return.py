"""The way back that skips a process: events a replica writes straight to the ingress that
started the request, on a socket the ingress listens on.

A disaggregated request's tokens are made on a decode replica, but the request was
started on the Serve replica that runs the Conductor. Rather than hand every token to the
Conductor to relay, the ingress names where it listens (``ReturnAddress``, in its
``StartPrompt``), the Serve replica gives each choice its ``ReturnRoute`` (that address,
the prompt's key, the choice's index and request id) and the Conductor passes the route
to the decode replica it places the choice on. The decode replica then writes, after each
step, one frame per ingress: ``[ReturnEntry, ...]``, each the events of one choice in that
step (``Delta``s, then its ``Done``), pickled behind a 4-byte big-endian length, as the
event channels frame theirs (``actors/serving/channel_socket.py``). A connection starts
with the address's token, so no other connection is read as the ingress's.

``attempt`` is the Conductor's attempt at the choice (1, 2, ... as it places it again
after a replica died): the ingress drops an older attempt's events and starts a newer
one's at its first token, so the tokens it already passed on are not sent twice.
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import Any

from actors.engine.events import Event

FRAME_LENGTH = struct.Struct("!I")
TOKEN_BYTES = 32


@dataclass(frozen=True)
class ReturnAddress:
    host: str
    port: int
    token: bytes  # sent first on every connection (``TOKEN_BYTES``)


@dataclass(frozen=True)
class ReturnRoute:
    """Where one choice's events go: the ingress's address, the prompt's key there, the
    choice's index in its prompt and its request id as the ingress built it; ``attempt``:
    the Conductor's attempt at it (set when it places the choice)."""

    address: ReturnAddress
    prompt: str
    index: int
    request_id: str
    attempt: int = 1


@dataclass(frozen=True)
class ReturnEntry:
    """One choice's events of one step, from the Conductor's ``attempt`` at it."""

    prompt: str
    index: int
    attempt: int
    events: list[Event]


def encode(batch: list[Any]) -> bytes:
    """One frame: the batch pickled, behind its length."""
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_LENGTH.pack(len(data)) + data
