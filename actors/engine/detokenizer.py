"""Incremental detokenization of one request's output, with stop strings.

Text is only released once it is stable: a trailing replacement character (half of a
multi-byte UTF-8 sequence) is held back, and so is any tail that could still grow into a
stop string. A stop string ends the request and is not part of the text.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False, check_stop: bool = True) -> str:
        """Append tokens; return the newly released text. ``final`` releases everything;
        ``check_stop=False`` looks for no stop string (``min_tokens`` not reached yet)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(full) if check_stop else None
        if cut is not None:
            self.stopped = True
            full = full[:cut]
        elif not final:
            full = full[: len(full) - self._unstable_tail(full)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = self.text + delta
        return delta

    def _first_stop(self, full: str) -> int | None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _unstable_tail(self, full: str) -> int:
        """Characters at the end of ``full`` that may still change or start a stop string."""
        hold = 0
        if full.endswith("\ufffd"):
            hold = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold
