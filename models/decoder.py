"""``CausalLM``: the Llama-family decoder (Llama, Mistral, Qwen2, Mixtral) over a paged KV cache.

Inputs are flat: a step's ``T`` tokens from any number of sequences, described by
``AttentionMetadata``. Projections are fused for speed: ``qkv_proj: [(Hq + 2 Hkv) * D, H]``
(q rows, then k, then v) and ``gate_up_proj: [2 * I, H]`` (gate rows, then up); the loader
concatenates the Hugging Face tensors into them. Layers hold weights only: the RoPE tables
and the attention backend belong to the model (or a ``ModelShard``), which passes them to
every layer call.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.attention_metadata import AttentionMetadata
from kernels.norm import RMSNorm
from kernels.registry import AttentionBackend, get_attention_backend
from kernels.rope import RotaryEmbedding, RotaryRows
from models.config import ModelConfig
from models.moe_block import SparseMoeBlock

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, Hkv, D]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding | RotaryRows,
        backend: AttentionBackend,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x: [T, H]`` -> ``[T, H]``; writes this step's K/V into ``kv_cache`` first."""
        tokens = x.shape[0]
        q, k, v = rope.split_qkv(self.qkv_proj(x), positions, self.num_heads, self.num_kv_heads)
        k_cache, v_cache = kv_cache
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out, _ = backend.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = SparseMoeBlock(config) if config.is_moe else MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding | RotaryRows,
        backend: AttentionBackend,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, positions, rope, backend, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding, ``num_hidden_layers`` decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = get_attention_backend(attention_backend)
        # built on the meta device and then loaded: no random init (a meta ``normal_``
        # imports torch._dynamo, over a second of CPU in every process that builds a model)
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(
            config.head_dim,
            max_positions=config.max_position_embeddings,
            theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids, positions: [T]`` int64 -> final-normed hidden states ``[T, H]``.

        ``kv_caches[i]`` is layer i's ``(k_cache, v_cache)``; the step's K/V are written at
        ``meta.slot_mapping`` before each layer attends.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)
        rope = self.rope.at(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, rope, self.attention_backend, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, H]`` -> logits ``[N, vocab]`` in float32 (whatever the model dtype)."""
        return self.lm_head(hidden).float()
