"""One worker's part of a model: a pipeline stage's layers, tensor-parallel slices of them.

Sequence-pipeline stage ``s`` of ``spp`` holds layers ``layer_range(L, spp, s)`` (earlier
stages take the remainder); the first stage also holds the embedding, the last the final
norm and LM head. Tensor-parallel rank ``r`` of ``tp`` holds query heads
``[r * Hq / tp, (r + 1) * Hq / tp)``, the KV heads ``kv_head_range(Hkv, tp, r)`` those query
heads use, and columns ``[r * I / tp, (r + 1) * I / tp)`` of every MLP (of every expert for
MoE). When ``tp > Hkv`` (``tp`` a multiple of ``Hkv``) each KV head is replicated on the
``tp / Hkv`` consecutive ranks that share it, so every rank holds exactly one. The attention
output projection and the MLP's down projection produce partial sums, which ``all_reduce``
adds up across the TP group (Megatron-style: one reduction after attention, one after the
MLP). Their biases live on rank 0 only, so the sum counts them once.

A shard runs its layers with one attention backend (the model's unless the constructor gets
another, e.g. KV-parallel attention) and, when given a ``LayerHook``, calls it after each layer
has written the step's K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from kernels.registry import AttentionBackend
from models.decoder import MLP, Attention, CausalLM, KVCache
from models.moe_block import SparseMoeBlock

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor in place over the TP group


class LayerHook(Protocol):
    def after_layer(self, layer: int, kv_cache: KVCache) -> None:
        """Called right after decoder layer ``layer`` (the model's global layer index, not
        the stage-local one) ran for the step and wrote its K/V into ``kv_cache``, that
        layer's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv_rank, D]``;
        the next layer has not started. A hook may also define ``before_layer(layer)``,
        called before the layer reads its cache (a per-layer KV load waits there)."""
        ...


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of the global KV heads TP rank ``rank`` of ``tp`` holds.

    ``tp <= num_kv_heads``: ``tp`` must divide them, each rank holds ``num_kv_heads / tp``.
    ``tp > num_kv_heads``: ``tp`` must be a multiple of them; rank ``r`` holds the one head
    ``r // (tp / num_kv_heads)``, replicated on the ranks that share it."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in [0, tp={tp})")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide the {num_kv_heads} KV heads")
        per_rank = num_kv_heads // tp
        return rank * per_rank, (rank + 1) * per_rank
    if tp % num_kv_heads:
        raise ValueError(
            f"tp={tp} is larger than the {num_kv_heads} KV heads, so it must be a multiple "
            f"of them (each KV head is then replicated on tp / {num_kv_heads} ranks)"
        )
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank holds (and caches): ``num_kv_heads / tp``, at least 1."""
    lo, hi = kv_head_range(num_kv_heads, tp, 0)
    return hi - lo


def layer_range(num_layers: int, spp: int, stage: int) -> tuple[int, int]:
    """``[lo, hi)`` of the layers stage ``stage`` of ``spp`` holds; stages are never empty."""
    if not 1 <= spp <= num_layers:
        raise ValueError(f"spp={spp} must be between 1 and the {num_layers} layers")
    if not 0 <= stage < spp:
        raise ValueError(f"stage {stage} is not in [0, {spp})")
    base, extra = divmod(num_layers, spp)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


class ReduceAfter(nn.Module):
    """``inner(x)`` summed over the TP group."""

    def __init__(self, inner: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x).contiguous()
        self.all_reduce(out)
        return out


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None)
    layer.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.requires_grad_(False)


def _shard_attention(attn: Attention, rank: int, tp: int, all_reduce: AllReduce) -> None:
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if hq % tp:
        raise ValueError(f"tp={tp} must divide the {hq} query heads")
    kv_lo, kv_hi = kv_head_range(hkv, tp, rank)
    # Query head h uses KV head h // (hq / hkv), so this rank's contiguous query heads all
    # use KV heads in [kv_lo, kv_hi) (one head when tp > hkv).
    lq, lkv = hq // tp, kv_hi - kv_lo
    rows = torch.cat(
        [
            torch.arange(rank * lq * d, (rank + 1) * lq * d),
            hq * d + torch.arange(kv_lo * d, kv_hi * d),
            (hq + hkv) * d + torch.arange(kv_lo * d, kv_hi * d),
        ]
    )
    qkv = attn.qkv_proj
    bias = qkv.bias[rows] if qkv.bias is not None else None
    attn.qkv_proj = _linear(qkv.weight[rows], bias)
    o = attn.o_proj
    o_bias = o.bias if (o.bias is not None and rank == 0) else None
    o_weight = o.weight[:, rank * lq * d : (rank + 1) * lq * d]
    attn.o_proj = ReduceAfter(_linear(o_weight, o_bias), all_reduce)  # type: ignore[assignment]
    attn.num_heads, attn.num_kv_heads = lq, lkv
    attn.q_size, attn.kv_size = lq * d, lkv * d


def _column_slices(inter: int, rank: int, tp: int) -> tuple[slice, torch.Tensor]:
    """This rank's MLP columns, and its rows of a fused ``[gate; up]`` weight."""
    if inter % tp:
        raise ValueError(f"tp={tp} must divide the intermediate size {inter}")
    part = inter // tp
    cols = slice(rank * part, (rank + 1) * part)
    gate = torch.arange(cols.start, cols.stop)
    return cols, torch.cat([gate, inter + gate])


def _shard_mlp(mlp: MLP, rank: int, tp: int, all_reduce: AllReduce) -> None:
    cols, rows = _column_slices(mlp.intermediate_size, rank, tp)
    mlp.gate_up_proj = _linear(mlp.gate_up_proj.weight[rows], None)
    mlp.down_proj = ReduceAfter(  # type: ignore[assignment]
        _linear(mlp.down_proj.weight[:, cols], None), all_reduce
    )
    mlp.intermediate_size = cols.stop - cols.start


def _shard_moe(moe: SparseMoeBlock, rank: int, tp: int) -> None:
    cols, rows = _column_slices(moe.intermediate_size, rank, tp)
    moe.w13 = nn.Parameter(moe.w13.data[:, rows].contiguous(), requires_grad=False)
    moe.w2 = nn.Parameter(moe.w2.data[:, :, cols].contiguous(), requires_grad=False)
    moe.intermediate_size = cols.stop - cols.start


class ModelShard(nn.Module):
    """The layers of one (stage, TP rank); same call shape as ``CausalLM.forward``.

    ``attention_backend``: what the layers attend with (default: the model's).
    ``layer_hook``: called after each layer (see ``LayerHook``); ``set_layer_hook`` sets or
    clears it later."""

    def __init__(
        self,
        model: CausalLM,
        stage: int = 0,
        spp: int = 1,
        tp_rank: int = 0,
        tp: int = 1,
        all_reduce: AllReduce | None = None,
        attention_backend: AttentionBackend | None = None,
        layer_hook: LayerHook | None = None,
    ) -> None:
        super().__init__()
        if tp > 1 and all_reduce is None:
            raise ValueError("tensor parallelism needs an all_reduce over the TP group")
        self.config = model.config
        self.lo, self.hi = layer_range(model.config.num_hidden_layers, spp, stage)
        self.is_first, self.is_last = stage == 0, stage == spp - 1
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(list(model.layers)[self.lo : self.hi])
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rope = model.rope
        self.attention_backend = (
            attention_backend if attention_backend is not None else model.attention_backend
        )
        self.layer_hook = layer_hook
        if tp > 1:
            assert all_reduce is not None
            for layer in self.layers:
                assert isinstance(layer.self_attn, Attention)
                _shard_attention(layer.self_attn, tp_rank, tp, all_reduce)
                if isinstance(layer.mlp, SparseMoeBlock):
                    _shard_moe(layer.mlp, tp_rank, tp)
                    layer.mlp = ReduceAfter(layer.mlp, all_reduce)
                else:
                    assert isinstance(layer.mlp, MLP)
                    _shard_mlp(layer.mlp, tp_rank, tp, all_reduce)
        self.num_kv_heads = kv_heads_per_rank(model.config.num_key_value_heads, tp)

    @property
    def num_layers(self) -> int:
        return self.hi - self.lo

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Call ``hook.after_layer`` after each layer from the next forward on (None: stop)."""
        self.layer_hook = hook

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First stage: ``input_ids [T]``; later stages: ``hidden [T, H]`` from the previous
        stage. Returns ``[T, H]``: final-normed on the last stage, raw residual otherwise."""
        if self.embed_tokens is not None:
            assert input_ids is not None
            x = self.embed_tokens(input_ids)
        else:
            assert hidden is not None
            x = hidden
        hook, backend = self.layer_hook, self.attention_backend
        before = getattr(hook, "before_layer", None)  # optional: e.g. wait for a KV load
        rope = self.rope.at(positions)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if before is not None:
                before(self.lo + index)
            x = layer(x, positions, rope, backend, kv_cache, meta)
            if hook is not None:
                hook.after_layer(self.lo + index, kv_cache)
        return self.norm(x) if self.norm is not None else x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [N, H]`` -> ``[N, vocab]`` float32; last stage only."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head(hidden).float()
