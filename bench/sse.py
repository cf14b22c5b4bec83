"""OpenAI server-sent events as a client reads them: the JSON chunk of each ``data:``
line, up to ``data: [DONE]``. The one parser every bench uses, sync (``httpx.Client``'s
``iter_lines``) and async (``AsyncClient``'s ``aiter_lines``).

A chunk carrying ``error`` raises ``StreamError``; lines that end before ``[DONE]`` raise
``StreamCut``: a stream counts as complete only when the server said so."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

DONE = "[DONE]"


class StreamError(RuntimeError):
    """The server ended the stream with an error chunk; ``error`` is its ``error`` field."""

    def __init__(self, error: Any) -> None:
        super().__init__(f"stream error: {error}")
        self.error = error

    @property
    def message(self) -> str:
        return str(self.error.get("message", "")) if isinstance(self.error, dict) else ""


class StreamCut(RuntimeError):
    """The stream's lines ended before ``data: [DONE]`` or an error chunk."""

    def __init__(self) -> None:
        super().__init__("stream ended without [DONE] or an error")


def _payload(line: str) -> str | None:
    """The data of a ``data:`` line; None for every other line (blank, comment, event)."""
    return line[5:].strip() if line.startswith("data:") else None


def _chunk(data: str) -> dict[str, Any]:
    chunk = json.loads(data)
    if "error" in chunk:
        raise StreamError(chunk["error"])
    return chunk


def sse_json(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a stream's lines, up to ``[DONE]``."""
    for line in lines:
        data = _payload(line)
        if data is None:
            continue
        if data == DONE:
            return
        yield _chunk(data)
    raise StreamCut()


async def sse_chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """``sse_json`` over an async stream of lines."""
    async for line in lines:
        data = _payload(line)
        if data is None:
            continue
        if data == DONE:
            return
        yield _chunk(data)
    raise StreamCut()
