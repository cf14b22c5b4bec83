"""A deterministic tiny random-weight model in Hugging Face format, for tests and the demo.

``write_tiny_model`` writes config.json, safetensors weights (optionally sharded with an
index), a byte-level BPE tokenizer.json, tokenizer_config.json (with a chat template) and
generation_config.json. The same seed writes the same bytes in every process.

Weight scales are chosen so the model is not trivially flat: embeddings ~N(0, 1), projections
~N(0, 1/fan_in) (unit-variance activations, attention scores of order 1), norm weights near 1
and the LM head ~N(0, 4/hidden), so logits spread over several units and greedy argmax
decisions are not near-ties.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig
from models.model_cache import cached_folder
from models.tiny_tokenizer import write_tiny_tokenizer

if TYPE_CHECKING:  # torch loads only to write weights: reading the model's folder needs none
    import torch

TINY_VERSION = "v1"
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}


def tiny_config(kind: str = "dense", **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` dict of the tiny model; ``overrides`` replace or add keys."""
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind must be 'dense' or 'moe', not {kind!r}")
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # small, so the tiny head_dim has frequencies in all three llama3 bands
            "original_max_position_embeddings": 256,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if kind == "moe":
        raw.update(
            architectures=["MixtralForCausalLM"],
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            sliding_window=None,
            rope_scaling=None,
        )
    raw.update(overrides)
    if "head_dim" not in overrides and raw.get("hidden_size") and raw.get("num_attention_heads"):
        # follow hidden_size / heads when those are overridden
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    arch = (raw.get("architectures") or [""])[0]
    raw["model_type"] = overrides.get("model_type", _MODEL_TYPES.get(arch, "llama"))
    return raw


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 tensors, drawn in a fixed order from one generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=1.0 / math.sqrt(in_features))

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    out = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(hidden)
        out[p + "post_attention_layernorm.weight"] = norm(hidden)
        for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            out[f"{p}self_attn.{name}.weight"] = linear(size, hidden)
            if config.qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = normal(size, std=0.5)
        out[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        if config.o_bias:
            out[p + "self_attn.o_proj.bias"] = normal(hidden, std=0.5)
        if config.is_moe:
            out[p + "block_sparse_moe.gate.weight"] = linear(config.num_local_experts, hidden)
            for j in range(config.num_local_experts):
                e = f"{p}block_sparse_moe.experts.{j}."
                out[e + "w1.weight"] = linear(inter, hidden)
                out[e + "w2.weight"] = linear(hidden, inter)
                out[e + "w3.weight"] = linear(inter, hidden)
        else:
            out[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            out[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            out[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    out["model.norm.weight"] = norm(hidden)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = normal(config.vocab_size, hidden, std=2.0 / math.sqrt(hidden))
    return out


def write_tiny_model(
    path: str | Path,
    kind: str = "dense",
    seed: int = 0,
    num_shards: int = 1,
    **config_overrides: Any,
) -> Path:
    """Write the tiny model into folder ``path`` (created if needed) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(kind, **config_overrides)
    config = ModelConfig.from_hf_dict(raw)
    tensors = random_weights(config, seed)
    _write_json(path / "config.json", raw)
    _write_weights(path, tensors, num_shards)
    write_tiny_tokenizer(path, config.vocab_size)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False},
    )
    return path


def tiny_model_dir(kind: str = "dense", num_key_value_heads: int | None = None) -> Path:
    """The built-in tiny model, written once into the model cache (``$MERIDIAN_CACHE``,
    default ``~/.cache/meridian``) as ``tiny-<kind>-v1``; safe when processes race to write it.

    ``num_key_value_heads`` (default 2) gives a variant with that many KV heads (and
    different random weights), written as ``tiny-<kind>-kv<n>-v1``."""
    name = f"tiny-{kind}" if num_key_value_heads is None else f"tiny-{kind}-kv{num_key_value_heads}"
    overrides = {} if num_key_value_heads is None else {"num_key_value_heads": num_key_value_heads}
    return cached_folder(
        f"{name}-{TINY_VERSION}",
        lambda folder: write_tiny_model(folder, kind=kind, **overrides),
        marker="config.json",
    )


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    from safetensors.torch import save_file

    names = list(tensors)
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        chunk = names[s * per_shard : (s + 1) * per_shard]
        file_name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(path / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(
        path / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_perturbed_copy(
    model_dir: str | Path, dest: str | Path, seed: int = 0, scale: float = 0.05
) -> tuple[dict[str, torch.Tensor], Path]:
    """Copy the model folder ``model_dir`` (one ``model.safetensors``) to ``dest`` with
    noise added to every weight (``scale`` times each tensor's mean magnitude): new weights
    of the same shapes, as a training step makes. Returns (those tensors, ``dest``)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dest = Path(model_dir), Path(dest)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: t + scale * t.abs().mean() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        for name, t in load_file(str(src / "model.safetensors")).items()
    }
    shutil.copytree(src, dest)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return tensors, dest
