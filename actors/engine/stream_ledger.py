"""No token twice: what a request's consumer was streamed, over every attempt at it.

A request whose replica died runs again from its prompt; its seed is resolved at the
edge, so the re-run draws the same tokens and first replays those already streamed.
``StreamLedger`` remembers, per choice, the tokens its consumer was sent and how many
the current attempt has produced, and says which part of an attempt's next tokens is
new. Used by the ingress's relay (``actors/serving/relay.py``: a prompt replayed on
another replica, events per choice) and by a disaggregated request
(``actors/disagg/pd_request.py``: one choice, re-placed by its Conductor).

Invariants: every token reaches the consumer at most once and in order; each choice ends
at most once; a ``Done`` passed on carries the tokens the consumer was streamed as its
prefix. A replay whose tokens differ from those sent raises ``ReplayDiverged``.
"""

from __future__ import annotations

from actors.engine.events import Delta, Done, Event, Failed


class ReplayDiverged(Exception):
    """A replay's tokens differ from those already streamed (``index``: the choice)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"choice {index}: the replay produced different tokens")
        self.index = index


class StreamLedger:
    def __init__(self, num_choices: int = 1) -> None:
        self.sent: list[list[int]] = [[] for _ in range(num_choices)]
        self.ended: set[int] = set()
        self._seen = [0] * num_choices  # per choice: tokens of the current attempt so far

    def open_choices(self) -> list[int]:
        return [i for i in range(len(self.sent)) if i not in self.ended]

    def begin_replay(self) -> None:
        """The next tokens come from a new attempt, starting at its first token."""
        self._seen = [0] * len(self.sent)

    def restart(self, i: int) -> None:
        """Choice ``i``'s next tokens come from a new attempt at it alone, from its first."""
        self._seen[i] = 0

    def replayed(self, i: int, count: int) -> int:
        """How many of choice ``i``'s next ``count`` tokens the consumer already has."""
        return max(0, min(count, len(self.sent[i]) - self._seen[i]))

    def take(self, i: int, tokens: list[int], check: bool = True) -> int:
        """Record the current attempt's next ``tokens`` of choice ``i``; returns how many
        of them (from the front) replay what the consumer has. The rest count as sent.
        ``check``: raise ReplayDiverged if a replayed token differs from the one sent."""
        start, old = self._seen[i], self.replayed(i, len(tokens))
        if check and self.sent[i][start : start + old] != tokens[:old]:
            raise ReplayDiverged(i)
        self._seen[i] = start + len(tokens)
        self.sent[i].extend(tokens[old:])
        return old

    def admit(self, item: Event) -> Event | None:
        """``item`` if the consumer has not had it, None if it has; raises ReplayDiverged,
        also for a delta that straddles what was streamed (its text cannot be split)."""
        i = item.index
        if i in self.ended:
            return None
        if isinstance(item, Delta):
            tokens = item.delta.token_ids
            if 0 < self.replayed(i, len(tokens)) < len(tokens):
                raise ReplayDiverged(i)
            return None if self.take(i, tokens) == len(tokens) else item
        if isinstance(item, Done):
            if item.output.token_ids[: len(self.sent[i])] != self.sent[i]:
                raise ReplayDiverged(i)
        assert isinstance(item, Done | Failed)
        self.ended.add(i)
        return item
