"""A MoE model split into its attention part and its experts (MegaScale-Infer's disaggregated
expert parallelism).

``AttentionPart``: what an attention worker holds: the embedding, every layer's norms,
attention and router (gate), the final norm and LM head. ``ExpertPart``: what an expert
worker holds: whole experts (not tensor slices), every layer's copy of each expert it was
given. Between them, per layer: the attention part routes each token to its top-k experts
(``kernels.moe.route`` / ``dispatch``), the (token, expert) rows travel to the experts'
workers, and the weighted expert outputs are combined back (``kernels.moe.combine``) in the
same order as ``SparseMoeBlock``, so the split model computes what ``CausalLM`` computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from kernels.moe import ExpertDispatch, combine, dispatch, route
from models.decoder import CausalLM, DecoderLayer, KVCache
from models.moe_block import SparseMoeBlock


class AttentionPart:
    """Everything of a MoE ``CausalLM`` but its experts."""

    def __init__(self, model: CausalLM) -> None:
        cfg = model.config
        if not cfg.is_moe:
            raise ValueError("attention/expert disaggregation needs a MoE model (Mixtral)")
        self.config = cfg
        self.num_experts = cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.embed_tokens = model.embed_tokens
        self.rope = model.rope
        self.backend = model.attention_backend
        self.norm = model.norm
        self.lm_head = model.lm_head
        layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        self.input_norms: list[nn.Module] = [layer.input_layernorm for layer in layers]
        self.attns: list[nn.Module] = [layer.self_attn for layer in layers]
        self.post_norms: list[nn.Module] = [layer.post_attention_layernorm for layer in layers]
        self.gates: list[nn.Module] = []
        for layer in model.layers:
            moe = layer.mlp
            assert isinstance(moe, SparseMoeBlock)
            self.gates.append(moe.gate)

    @property
    def num_layers(self) -> int:
        return len(self.attns)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` -> ``[T, H]``."""
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def attend(
        self,
        layer: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata | Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s attention half: ``x [T, H]`` -> ``(x + attn, post-norm h)``, both
        ``[T, H]``; writes the step's K/V into ``kv_cache``."""
        h = self.input_norms[layer](x)
        x = x + self.attns[layer](h, positions, self.rope, self.backend, kv_cache, meta)
        return x, self.post_norms[layer](x)

    @torch.inference_mode()
    def route(
        self, layer: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExpertDispatch]:
        """``h [T, H]`` -> ``(weights [T, k] fp32, grouped rows [T*k, H], dispatch)``: the rows
        in dispatch order (expert-major), as ``SparseMoeBlock`` groups them."""
        weights, expert_ids = route(self.gates[layer](h), self.top_k)
        plan = dispatch(expert_ids, self.num_experts)
        return weights, h.index_select(0, plan.token_ids), plan

    @staticmethod
    def combine(
        x: torch.Tensor, expert_out: torch.Tensor, plan: ExpertDispatch, weights: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output: ``x + sum_k w_k * expert_k(h)``; ``expert_out [T*k, H]`` in
        dispatch order."""
        return x + combine(expert_out, plan, weights, x.shape[0])

    @torch.inference_mode()
    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class ExpertPart:
    """Whole experts ``experts`` of every layer of a MoE ``CausalLM``."""

    def __init__(self, model: CausalLM, experts: list[int] | tuple[int, ...]) -> None:
        cfg = model.config
        if not cfg.is_moe:
            raise ValueError("attention/expert disaggregation needs a MoE model (Mixtral)")
        bad = [e for e in experts if not 0 <= e < cfg.num_local_experts]
        if bad:
            raise ValueError(f"experts {bad} not in [0, {cfg.num_local_experts})")
        self.experts = tuple(sorted(experts))
        self.intermediate_size = cfg.intermediate_size
        # weights[layer][expert] = (w13 [2I, H], w2 [H, I]), copies (the model is dropped)
        self.weights: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in model.layers:
            moe = layer.mlp
            assert isinstance(moe, SparseMoeBlock)
            self.weights.append(
                {e: (moe.w13.data[e].clone(), moe.w2.data[e].clone()) for e in self.experts}
            )

    @torch.inference_mode()
    def run(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` of layer ``layer`` on ``x [n, H]`` -> ``[n, H]`` (the arithmetic
        of ``SparseMoeBlock.expert``)."""
        try:
            w13, w2 = self.weights[layer][expert]
        except KeyError:
            raise ValueError(f"expert {expert} is not held here (held: {self.experts})") from None
        gate, up = F.linear(x, w13).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate).mul_(up), w2)
