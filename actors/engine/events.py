"""What a replica tells the caller of one request, in order: typed, never tagged tuples.

A submitted request is answered first with exactly one ``Accepted`` or ``Refused``; an
accepted one then streams ``Delta``s and ends with exactly one ``Done`` or ``Failed`` per
choice (``index``: the choice, 0 for a request with one). Every event pickles as is, so the
same records travel from an engine thread to an event loop and from a replica actor to
the ingress.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.outputs import RequestOutput, StreamDelta
from errors import EngineUnavailableError, InvalidRequestError, MeridianError, OverloadedError


@dataclass(frozen=True)
class Accepted:
    replica_id: str  # who took it (its ``EngineLoop``'s id; empty outside a Serve replica)


@dataclass(frozen=True)
class Refused:
    """Nothing of the request was queued. ``status``: 400 bad input, 429 overloaded (with
    the engine's ``retry_after`` seconds or None), 503 the replica failed to take it."""

    status: int
    message: str
    retry_after: float | None = None

    @staticmethod
    def of(error: MeridianError) -> Refused:
        return Refused(error.http_status, str(error), getattr(error, "retry_after", None))

    def error(self) -> MeridianError:
        """The refusal as the exception the in-process engine raises for it."""
        if self.status == 429:
            return OverloadedError(self.message, self.retry_after)
        if 400 <= self.status < 500:
            return InvalidRequestError(self.message)
        return EngineUnavailableError(self.message)


@dataclass(frozen=True)
class Delta:
    index: int
    delta: StreamDelta


@dataclass(frozen=True)
class Done:
    index: int
    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The choice ended without its tokens (a dead worker, a shutdown, a lost request);
    ``retriable``: running it again can succeed."""

    index: int
    message: str
    retriable: bool = True


Verdict = Accepted | Refused
Event = Delta | Done | Failed
