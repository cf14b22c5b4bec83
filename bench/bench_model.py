"""The model the CPU benches run: a random-weight Llama-style model of 8 layers, hidden 512
(fp32, written in Hugging Face format), long enough for multi-thousand-token prompts."""

from __future__ import annotations

from pathlib import Path

import torch

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


def write_qwen2_05b(folder: str | Path, gguf_values: bool = False, bf16: bool = False) -> Path:
    """Write a random-weight model of Qwen2-0.5B's shape into ``folder`` and return it. With
    ``gguf_values`` its weights are those a GGUF file of it quantized as SmolLM2's package
    is (linear layers Q4_1, the embedding Q8_0) dequantizes to, as a loader reads them;
    with ``bf16`` they are stored in bf16, as Qwen2-0.5B's own checkpoint is."""
    path = write_tiny_model(Path(folder), kind="dense", seed=0, **QWEN2_05B)
    if gguf_values:
        write_gguf_values(path)
    if bf16:
        write_bf16(path)
    return path


def write_bf16(model_dir: Path) -> None:
    """Store every floating tensor of ``model_dir``'s ``model.safetensors`` in bf16 (rounded
    to nearest even), as most Hugging Face checkpoints are; ``config.json``'s
    ``torch_dtype`` says so."""
    import json

    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    save_file(
        {n: w.to(torch.bfloat16) if w.is_floating_point() else w for n, w in weights.items()},
        str(path),
        metadata={"format": "pt"},
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def gguf_round_trip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` quantized to the GGUF type ``kind`` ("Q4_1", "Q8_0", ...) and dequantized
    by the gguf library, as a loader reads it: fp32, the same shape."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(weight.detach().float().numpy(), qtype)
    values = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(weight.shape)
    return torch.from_numpy(values.copy())


def write_gguf_values(model_dir: Path) -> None:
    """Replace every 2-D weight of ``model_dir``'s ``model.safetensors`` (inner size a
    multiple of 32) by its Q4_1 (the embedding: Q8_0) round trip through the gguf library."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0:
            kind = "Q8_0" if "embed" in name else "Q4_1"
            weights[name] = gguf_round_trip(w, kind).to(w.dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
