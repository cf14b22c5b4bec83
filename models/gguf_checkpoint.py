"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint.

``GGUFCheckpoint(path)`` gives what a Hugging Face folder holds: ``hf_config()`` (the
``config.json`` dict), ``tensor_names()`` and ``tensor(name)`` under Hugging Face names,
dequantized by the ``gguf`` library to float32. The tokenizer is in ``models/gguf_tokenizer.py``.

Supported: architecture ``llama`` (Llama, Mistral; Mixtral when it has experts) and ``qwen2``;
every tensor type the ``gguf`` library dequantizes. Anything else is refused with a
``ModelLoadError`` naming it.

llama.cpp stores the rows of ``attn_q`` / ``attn_k`` of a ``llama`` file permuted for its
interleaved RoPE: within each head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]`` of the
Hugging Face half-split layout. ``tensor`` undoes that (``unpermute_rope_rows``); ``qwen2``
files are not permuted.
"""

from __future__ import annotations

import re
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

# GGUF names of one layer's tensors -> Hugging Face names (``{i}``: layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Stacked experts [E, rows, cols] -> one Mixtral tensor per expert.
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "w1",
    "ffn_up_exps.weight": "w3",
    "ffn_down_exps.weight": "w2",
}
# Older Mixtral files store one tensor per expert: blk.i.ffn_gate.j.weight.
_OLD_EXPERT = re.compile(r"^(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_OLD_EXPERT_NAMES = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(GGUF_SUFFIX)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The file at ``path``, parsed once per process while it is unchanged (parsing a
    50k-token vocabulary takes seconds; config, tokenizer and weights all read it)."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except OSError as exc:
        raise ModelLoadError(f"{path} not found") from exc
    return _open_cached(resolved, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. ``rows``: [num_heads * head_dim, hidden].

    Per head, llama.cpp row ``2j`` is HF row ``j`` and row ``2j + 1`` is HF row
    ``j + head_dim / 2``.
    """
    head_dim = rows.shape[0] // num_heads
    shaped = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return shaped.swapaxes(1, 2).reshape(rows.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path} not found")
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as exc:  # the reader raises ValueError / struct errors on bad files
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self.field("general.architecture", ""))
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        self._check_tensor_types()

    def field(self, key: str, default: Any = None) -> Any:
        found = self._reader.fields.get(key)
        return default if found is None else found.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    @cached_property
    def _tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self._reader.tensors}

    def _check_tensor_types(self) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import _type_traits

        plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
        for tensor in self._reader.tensors:
            qtype = tensor.tensor_type
            if qtype not in plain and qtype not in _type_traits:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {tensor.name} has quantization {qtype.name}, "
                    "which the gguf library cannot dequantize"
                )
        if "rope_freqs.weight" in self._tensors:
            raise ModelLoadError(
                f"{self.path.name}: per-frequency RoPE factors (rope_freqs.weight, "
                "Llama 3.1-style scaling) are not supported"
            )

    @cached_property
    def num_experts(self) -> int:
        return int(self.arch_field("expert_count", 0) or 0)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` this file's metadata describes."""
        heads = int(self.arch_field("attention.head_count"))
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        hidden = int(self.arch_field("embedding_length"))
        head_dim = int(self.arch_field("attention.key_length", hidden // heads))
        scaling = self.arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ModelLoadError(
                f"{self.path.name}: rope scaling {scaling!r} is not supported in GGUF files"
            )
        vocab = self.arch_field("vocab_size")
        if vocab is None:
            vocab = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        if self.architecture == "qwen2":
            arch, model_type = "Qwen2ForCausalLM", "qwen2"
        elif self.num_experts:
            arch, model_type = "MixtralForCausalLM", "mixtral"
        else:
            arch, model_type = "LlamaForCausalLM", "llama"
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        if self.num_experts:
            config["num_local_experts"] = self.num_experts
            config["num_experts_per_tok"] = int(self.arch_field("expert_used_count", 2))
        if arch == "LlamaForCausalLM":
            config["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
        return config

    @cached_property
    def _sources(self) -> dict[str, tuple[str, int | None]]:
        """HF name -> (GGUF name, expert index or None)."""
        out: dict[str, tuple[str, int | None]] = {}
        for name in self._tensors:
            if name in _GLOBAL_NAMES:
                out[_GLOBAL_NAMES[name]] = (name, None)
                continue
            match = _BLOCK.match(name)
            if match is None:
                raise ModelLoadError(f"{self.path.name}: unexpected tensor {name}")
            layer, rest = match.group(1), match.group(2)
            prefix = f"model.layers.{layer}."
            if rest in _EXPERT_NAMES:
                for j in range(self.num_experts):
                    hf = f"{prefix}block_sparse_moe.experts.{j}.{_EXPERT_NAMES[rest]}.weight"
                    out[hf] = (name, j)
            elif (old := _OLD_EXPERT.match(rest)) is not None:
                kind, j = old.group(1), int(old.group(2))
                hf = f"{prefix}block_sparse_moe.experts.{j}.{_OLD_EXPERT_NAMES[kind]}.weight"
                out[hf] = (name, None)
            elif rest in _LAYER_NAMES:
                out[prefix + _LAYER_NAMES[rest]] = (name, None)
            else:
                raise ModelLoadError(f"{self.path.name}: unexpected tensor {name}")
        return out

    def tensor_names(self) -> list[str]:
        return list(self._sources)

    def tensor(self, hf_name: str) -> np.ndarray:
        """The tensor stored for ``hf_name``, float32, in Hugging Face's layout."""
        name, expert = self._sources[hf_name]
        if expert is not None:  # one expert of a stacked [E, rows, cols] tensor
            return np.array(self._stacked(name)[expert], dtype=np.float32, order="C")
        data = self._dequantized(name)
        if self.architecture == "llama":
            heads = int(self.arch_field("attention.head_count"))
            if name.endswith(("attn_q.weight", "attn_q.bias")):
                data = unpermute_rope_rows(data, heads)
            elif name.endswith(("attn_k.weight", "attn_k.bias")):
                data = unpermute_rope_rows(
                    data, int(self.arch_field("attention.head_count_kv", heads))
                )
        # copied only where needed: an F32 tensor is a read-only view of the mapped file
        return np.require(data, dtype=np.float32, requirements=["C", "W"])

    def _dequantized(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        stored = self._tensors[name]
        try:
            data = dequantize(stored.data, stored.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(f"{self.path.name}: cannot dequantize {name}: {exc}") from exc
        # GGUF lists dimensions fastest first; numpy's shape is the reverse.
        return np.asarray(data, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(stored.shape))
        )

    @lru_cache(maxsize=3)  # noqa: B019 (a checkpoint lives as long as its process's cache)
    def _stacked(self, name: str) -> np.ndarray:
        """A stacked experts tensor, dequantized once for all its experts (w1, w2, w3 of a
        layer load in turn)."""
        return self._dequantized(name)
