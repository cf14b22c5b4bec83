"""``ModelConfig``: the fields of a Hugging Face ``config.json`` the runtime needs.

Pure data: ``from_hf_dict`` parses an already-read dict (``read_model_config`` reads the file).
Supported architectures: Llama, Mistral and Qwen2 (dense, GQA, SwiGLU) and Mixtral (sparse MoE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from errors import ModelLoadError
from kernels.rope_types import SUPPORTED_ROPE_TYPES, rope_type_of
from models.gguf_checkpoint import is_gguf, open_gguf
from models.pretrained import resolve_model

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
)
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
DTYPES = ("float32", "float16", "bfloat16")  # the checkpoint dtypes read, by their torch name


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    # Longest context served: max_position_embeddings, capped by a sliding window if one is
    # set (within the window, sliding-window attention equals full attention).
    max_model_len: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama attention_bias)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_local_experts: int = 0  # 0: dense SwiGLU MLP in every layer
    num_experts_per_tok: int = 0
    dtype: str = "float32"  # one of DTYPES
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The checkpoint's dtype (torch loads here, not at import: the ingress reads
        configs without it)."""
        import torch

        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; ModelLoadError says what is missing or unsupported."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [name for name in _REQUIRED if raw.get(name) is None]
        if missing:
            raise ModelLoadError(f"config.json ({arch}) lacks required field(s): {missing}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported; only 'silu' is")
        if raw.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, rope_scaling = _rope_parameters(raw)
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            window = None
        max_len = min(max_pos, int(window)) if window else max_pos
        attention_bias = bool(raw.get("attention_bias", False))
        experts = int(raw.get("num_local_experts") or 0) if arch == "MixtralForCausalLM" else 0
        top_k = int(raw.get("num_experts_per_tok") or 2) if experts else 0
        if arch == "MixtralForCausalLM" and experts <= 0:
            raise ModelLoadError("MixtralForCausalLM config needs num_local_experts > 0")
        if experts and not 0 < top_k <= experts:
            raise ModelLoadError(f"num_experts_per_tok {top_k} must be in 1..{experts}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else _opt_ids(eos)
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ModelLoadError(
                f"dtype {dtype_name!r} is not supported; use one of {list(DTYPES)}"
            )
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            max_model_len=max_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            bos_token_id=_opt_int(raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            dtype=dtype_name,
            extra=raw,
        )


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The config of a Hugging Face folder, of a ``.gguf`` file (from its metadata), or of a
    pretrained model by name (``models/pretrained.py``)."""
    model_dir = resolve_model(model_dir)
    if is_gguf(model_dir):
        return ModelConfig.from_hf_dict(open_gguf(model_dir).hf_config())
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a model folder needs a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return ModelConfig.from_hf_dict(raw)


def _rope_parameters(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the legacy ``rope_theta`` + ``rope_scaling`` keys or the
    ``rope_parameters`` dict that transformers 5 writes."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = rope_type_of(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if kind == "default":
        return theta, None
    assert scaling is not None
    scaling = dict(scaling)
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        need = ("factor", "low_freq_factor", "high_freq_factor")
        if any(scaling.get(k) is None for k in need):
            raise ModelLoadError(f"llama3 rope_scaling needs {need}, got {scaling}")
    if kind == "linear" and scaling.get("factor") is None:
        raise ModelLoadError("linear rope_scaling needs a factor")
    return theta, scaling


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_ids(value: Any) -> tuple[int, ...]:
    return () if value is None else (int(value),)
