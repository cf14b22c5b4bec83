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


# Qwen2-0.5B's shape (random weights): 24 layers, hidden 896, 14 query and 2 KV heads,
# q/k/v biases, tied embeddings over a 151,936-token vocabulary (about 0.5 B parameters).
QWEN2_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    attention_bias=True,
    rope_theta=1000000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
)


def write_qwen2_05b(folder: str | Path) -> Path:
    """Write a random-weight model of Qwen2-0.5B's shape into ``folder`` and return it."""
    return write_tiny_model(Path(folder), kind="dense", seed=0, **QWEN2_05B)
