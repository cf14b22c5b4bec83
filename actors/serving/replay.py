"""Continuing one prompt's stream on another replica when its replica dies mid-request.

A request's seed is resolved at the edge, so running it again on any replica draws the
same tokens. ``StreamLedger`` remembers, per choice, the tokens its consumer already got;
during a replay it drops every event the consumer has seen, after checking that the replay
produced exactly those tokens, and passes on only what is new. A replay that produced
different tokens raises ``ReplayDiverged``: the caller ends those choices with a retriable
error rather than stream a continuation of tokens it did not send.

Invariants: every token reaches the consumer at most once and in order; each choice ends
at most once; a ``Done`` passed on carries the tokens the consumer was streamed as its
prefix.
"""

from __future__ import annotations

from actors.engine.events import Delta, Done, Event, Failed


class ReplayDiverged(Exception):
    """A replay's tokens differ from those already streamed (``index``: the choice)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"choice {index}: the replay produced different tokens")
        self.index = index


class StreamLedger:
    def __init__(self, num_choices: int) -> None:
        self.sent: list[list[int]] = [[] for _ in range(num_choices)]
        self.ended: set[int] = set()
        self._seen = [0] * num_choices  # per choice: tokens of the current attempt so far

    def open_choices(self) -> list[int]:
        return [i for i in range(len(self.sent)) if i not in self.ended]

    def begin_replay(self) -> None:
        """The next events come from a new attempt, starting at its first token."""
        self._seen = [0] * len(self.sent)

    def admit(self, item: Event) -> Event | None:
        """``item`` if the consumer has not had it, None if it has; raises ReplayDiverged."""
        i = item.index
        if i in self.ended:
            return None
        if isinstance(item, Delta):
            tokens, start, have = item.delta.token_ids, self._seen[i], len(self.sent[i])
            self._seen[i] = start + len(tokens)
            if start + len(tokens) <= have:  # already streamed: must be the same tokens
                if self.sent[i][start : start + len(tokens)] != tokens:
                    raise ReplayDiverged(i)
                return None
            if start < have:  # straddles what was streamed: cannot be split exactly
                raise ReplayDiverged(i)
            self.sent[i].extend(tokens)
            return item
        if isinstance(item, Done):
            if item.output.token_ids[: len(self.sent[i])] != self.sent[i]:
                raise ReplayDiverged(i)
        assert isinstance(item, Done | Failed)
        self.ended.add(i)
        return item
