"""Thin runtime objects around the engine; ``from actors import LLM, SamplingParams``.

The names load on first use (PEP 562), so a process that imports only part of ``actors``
(the router's or the ingress's Serve replica) does not load torch and the engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.engine.outputs import RequestOutput, StreamDelta
    from actors.llm import LLM
    from policies.request import SamplingParams

_WHERE = {
    "LLM": "actors.llm",
    "RequestOutput": "actors.engine.outputs",
    "SamplingParams": "policies.request",
    "StreamDelta": "actors.engine.outputs",
}
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamDelta"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
