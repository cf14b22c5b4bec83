"""Model definitions (Llama-family dense and Mixtral-style MoE), Hugging Face loading, the
tokenizer wrapper and the deterministic tiny test model."""

from models.config import ModelConfig, read_model_config
from models.decoder import CausalLM
from models.loader import load_model
from models.tiny import tiny_model_dir, write_tiny_model
from models.tokenizer import Tokenizer, load_tokenizer

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
