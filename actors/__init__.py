"""Thin runtime objects around the engine; ``from actors import LLM, SamplingParams``."""

from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.sampling import SamplingParams
from actors.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
