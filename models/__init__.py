"""Model definitions (Llama-family dense and Mixtral-style MoE), Hugging Face loading, the
tokenizer wrapper and the deterministic tiny test model.

The names load on first use (PEP 562), so a process that needs only the tokenizer (the
ingress) does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.config import ModelConfig, read_model_config
    from models.decoder import CausalLM
    from models.loader import load_model
    from models.tiny import tiny_model_dir, write_tiny_model
    from models.tokenizer import Tokenizer, load_tokenizer

_WHERE = {
    "CausalLM": "models.decoder",
    "ModelConfig": "models.config",
    "Tokenizer": "models.tokenizer",
    "load_model": "models.loader",
    "load_tokenizer": "models.tokenizer",
    "read_model_config": "models.config",
    "tiny_model_dir": "models.tiny",
    "write_tiny_model": "models.tiny",
}
__all__ = [
    "CausalLM",
    "ModelConfig",
    "Tokenizer",
    "load_model",
    "load_tokenizer",
    "read_model_config",
    "tiny_model_dir",
    "write_tiny_model",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
