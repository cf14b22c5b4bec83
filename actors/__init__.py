"""Thin runtime objects around the engine; ``from actors import LLM, SamplingParams``."""

from actors.llm import LLM
from actors.outputs import RequestOutput, StreamDelta
from actors.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
