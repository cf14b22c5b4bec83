"""Model architectures for the cost model: only the shapes that set FLOPs and bytes.

Parameter counts are derived from the shapes (so a spec cannot disagree with itself):
per layer, attention ``d*(hq*hd) + 2*d*(hkv*hd) + (hq*hd)*d`` and a gated MLP ``3*d*ffn``
per expert; embeddings and LM head ``2*vocab*d`` (untied). A MoE layer routes each token to
``top_k`` of ``num_experts`` experts, so active parameters are far fewer than total.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int  # intermediate size of one (expert) MLP
    vocab: int
    num_experts: int = 1  # 1 = dense
    top_k: int = 1
    dtype_bytes: int = 2

    @property
    def attn_params_per_layer(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.ffn

    @property
    def total_params(self) -> int:
        router = self.hidden * self.num_experts if self.num_experts > 1 else 0
        layer = self.attn_params_per_layer + self.num_experts * self.expert_params + router
        return self.num_layers * layer + 2 * self.vocab * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (what sets linear FLOPs per token)."""
        layer = self.attn_params_per_layer + self.top_k * self.expert_params
        return self.num_layers * layer + 2 * self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (Mooncake: l * 2d/gqa * s)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        # Mooncake's experiments: a dummy LLaMA-70B (Table 1 gives LLaMA3-70B shapes).
        ModelSpec("llama2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        ModelSpec("mixtral-8x22b", 56, 6144, 48, 8, 128, 16384, 32768, num_experts=8, top_k=2),
        ModelSpec("dbrx", 40, 6144, 48, 8, 128, 10752, 100352, num_experts=16, top_k=4),
        # The deterministic tiny random-weight model the CPU engine and tests run.
        ModelSpec("tiny", 4, 64, 4, 2, 16, 128, 512),
    ]
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
