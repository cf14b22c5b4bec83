"""The model the CPU benches run: a random-weight Llama-style model of 8 layers, hidden 512
(fp32, written in Hugging Face format), long enough for multi-thousand-token prompts."""

from __future__ import annotations

from pathlib import Path

from models import write_tiny_model

MODEL = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    vocab_size=8192,
    max_position_embeddings=8192,
)


def write_bench_model(folder: str | Path) -> Path:
    """Write the bench model into ``folder`` (created) and return it."""
    return write_tiny_model(Path(folder), kind="dense", seed=0, **MODEL)
