"""A prompt started on a replica: the one record of it in the replica's process.

The caller that starts a prompt (an ingress's event channel, ``replica_channel.py``, or
``EngineLoop.stream``) makes the record and hands it to ``EngineLoop.submit``; the engine
thread answers its verdict, then puts its events in its outlet's batch for the step, and
counts its choices down. Nothing else tracks which of its choices are still open: the
caller reads ``ended`` and sets ``dropped``.

    prompt = OpenPrompt(requests, outlet, answer)
    loop.submit(prompt)          # answer(Accepted | Refused) on the engine thread, once
    outlet.send(batch)           # the engine thread, at most once per step and outlet:
                                 #   [(key, [event, ...]), ...], one entry per prompt,
                                 #   its list ending with None after the prompt's last

A prompt with a ``reply`` address whose engine takes routes (``add_routed``: a
disaggregated group's) is ``direct``: its choices' tokens and ``Done``s go from their
decode replicas straight to that address, and its outlet carries only ``Failed``s, never
the None (the ingress ends the prompt when each choice ended).

Invariants: ``remaining`` and ``ended`` are written only on the engine thread; a batch
holds at most one entry per prompt, its events in order; an accepted prompt's last event
is followed by None in the same list (not for a ``direct`` one); a prompt ``dropped`` by
its caller (before the engine thread aborts it) sends nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from actors.engine.direct_return import ReturnAddress
from actors.engine.events import Event, Verdict
from policies.request import Request

Entry = tuple[str, list[Event | None]]  # (prompt key, its events); None after its last


class Outlet(Protocol):
    def send(self, batch: list[Entry]) -> None:
        """The engine thread: one step's events of this outlet's prompts, by prompt."""
        ...


@dataclass(eq=False)
class OpenPrompt:
    requests: list[Request]  # its choices; choice i is ``Event.index`` i
    outlet: Outlet
    answer: Callable[[Verdict], object]  # called once, on the engine thread
    remaining: int = 0  # choices accepted and not ended (engine thread)
    ended: bool = False  # its last choice ended, or it was refused (engine thread)
    dropped: bool = False  # its caller aborted it: nothing more is sent (caller)
    reply: ReturnAddress | None = None  # where its caller listens for direct events
    direct: bool = False  # its engine sends its events to ``reply`` (engine thread)

    @property
    def key(self) -> str:
        """The prompt's id on the way back: its first choice's request id."""
        return self.requests[0].request_id

    @property
    def ids(self) -> list[str]:
        return [r.request_id for r in self.requests]
