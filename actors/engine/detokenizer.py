"""Incremental detokenization of one request's output, with stop strings.

Text is only released once it is stable: a trailing replacement character (half of a
multi-byte UTF-8 sequence) is held back, and so is any tail that could still grow into a
stop string. A stop string ends the request and is not part of the text.

Each step decodes a window, not the whole output (decoding all of it every step costs
O(n) a token, O(n^2) a request: about 0.3 us a token with SmolLM2's tokenizer, so 300 us a
step at 1,000 tokens, per request). Invariant: ``_stable`` is the decode of
``token_ids[:_read]``, which ends on a whole character, as does ``token_ids[:_prefix]``.
The new tokens' text is the decode of ``token_ids[_prefix:]`` past the decode of
``token_ids[_prefix:_read]``: the tokens before them are decoded with them as context, so
a tokenizer that drops a leading space at the start of a decode, or joins word pieces,
joins them as it would in the whole text. Where the window's text does not begin with its
context's (a tokenizer whose text depends on more than that), the whole output is decoded.
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
        self._stable = ""  # the decode of token_ids[:_read] (see the module doc)
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: list[int], final: bool = False, check_stop: bool = True) -> str:
        """Append tokens; return the newly released text. ``final`` releases everything;
        ``check_stop=False`` looks for no stop string (``min_tokens`` not reached yet)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self._decoded()
        cut = self._first_stop(full) if check_stop else None
        if cut is not None:
            self.stopped = True
            full = full[:cut]
        elif not final:
            full = full[: len(full) - self._unstable_tail(full)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = self.text + delta
        return delta

    def _decoded(self) -> str:
        """The decode of every token so far, from the window (module doc)."""
        ids, decode = self.token_ids, self.tokenizer.decode
        context = decode(ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(ids[self._prefix :], skip_special_tokens=True)
        if window.startswith(context):
            full = self._stable + window[len(context) :]
        else:
            full = decode(ids, skip_special_tokens=True)
        if full and not full.endswith("\ufffd"):  # ends on a whole character
            self._stable, self._prefix, self._read = full, self._read, len(ids)
        return full

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
