"""Paged attention in plain torch: the reference backend, CPU and GPU.

One step is vectorised over the batch: each sequence's KV is gathered through its block table
into a padded ``[B, L, Hkv, D]`` tensor (``L = ceil(max_context_len / block_size) * block_size``),
queries are padded to ``[B, max_q, Hq, D]``, and a masked matmul-softmax-matmul runs for the
whole batch (on CPU torch's fused flash-attention kernel, which reads the gathered KV in place
and returns the log-sum-exp; elsewhere a plain batched matmul). GQA never repeats KV: query
head ``h`` is served by KV head ``h // group`` (the Hugging Face ``repeat_kv`` convention),
so queries are regrouped as ``[B, max_q, Hkv, group, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels.attention_metadata import AttentionMetadata


@dataclass
class TorchAttentionPlan:
    """Per-step index work shared by every layer of the step."""

    flat_block_ids: torch.Tensor  # [B * nb] int64, the blocks covering max_context_len, per seq
    blocked: torch.Tensor  # [B, max_q, 1, L] bool: query row i of b must NOT see key j
    # [T] int64 row of token t in [B * max_q]; None when every sequence has exactly one query
    pad_index: torch.Tensor | None
    max_q: int
    num_blocks: int  # nb
    _masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """``[B, 1, max_q * group, L]``: 0 where visible, -inf where blocked; query row
        ``i * group + g`` is query i, group member g. Built once per step and dtype."""
        key = (dtype, group)
        if key not in self._masks:
            num_seqs, max_q, _, length = self.blocked.shape
            blocked = self.blocked.expand(num_seqs, max_q, group, length)
            blocked = blocked.reshape(num_seqs, 1, max_q * group, length)
            mask = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
            self._masks[key] = mask.masked_fill_(blocked, float("-inf"))
        return self._masks[key]


def plan_attention(meta: AttentionMetadata) -> TorchAttentionPlan:
    """Index tensors for one step; cost is independent of the number of layers."""
    device = meta.context_lens.device
    num_seqs = meta.num_seqs
    max_q = max(int(meta.max_query_len), 1)
    nb = max(math.ceil(int(meta.max_context_len) / meta.block_size), 1)
    if meta.block_tables.shape[1] < nb:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns but max_context_len "
            f"{meta.max_context_len} needs {nb} blocks of {meta.block_size}"
        )
    length = nb * meta.block_size
    query_lens = meta.query_start[1:] - meta.query_start[:-1]  # [B]
    ctx = meta.context_lens  # [B]
    rows = torch.arange(max_q, device=device)  # [max_q]
    keys = torch.arange(length, device=device)  # [L]
    # Position of query row i of sequence b; rows past query_lens[b] are padding.
    offsets = ctx - query_lens if meta.query_offsets is None else meta.query_offsets
    q_pos = offsets[:, None] + rows[None, :]  # [B, max_q]
    blocked = (keys[None, None, :] > q_pos[:, :, None]) | (
        keys[None, None, :] >= ctx[:, None, None]
    )
    num_tokens = int(meta.slot_mapping.shape[0])
    pad_index = None
    if max_q > 1 or num_tokens != num_seqs:
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
        )  # [T]
        offset = torch.arange(num_tokens, device=device) - meta.query_start[seq_of_token]
        pad_index = seq_of_token * max_q + offset
    return TorchAttentionPlan(
        flat_block_ids=meta.block_tables[:, :nb].reshape(-1),
        blocked=blocked.view(num_seqs, max_q, 1, length),
        pad_index=pad_index,
        max_q=max_q,
        num_blocks=nb,
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``k_cache[slot // bs, slot % bs] = k[t]`` for every token t (and the same for v)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    plan: TorchAttentionPlan | None = None,
    workspace: Workspace | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [T, Hq, D]`` -> ``(out [T, Hq, D], lse [T, Hq] float32, natural log)``.

    ``impl``: "flash_cpu" (torch's fused CPU flash-attention kernel, reads the gathered KV in
    place), "batched" (plain matmul-softmax-matmul, any device) or "auto" (the first on CPU).
    """
    if plan is None:
        plan = plan_attention(meta)
    if workspace is None:
        workspace = Workspace()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    num_seqs, max_q = meta.num_seqs, plan.max_q
    kv_shape = (num_seqs, plan.num_blocks * block_size, num_kv_heads, head_dim)  # [B, L, Hkv, D]
    keys = workspace.gather(0, k_cache, plan.flat_block_ids).view(kv_shape)
    values = workspace.gather(1, v_cache, plan.flat_block_ids).view(kv_shape)

    # Queries: [T, Hq, D] -> [B, max_q, Hkv, G, D]
    if plan.pad_index is None:
        queries = q.view(num_seqs, 1, num_kv_heads, group, head_dim)
    else:
        queries = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
        queries.index_copy_(0, plan.pad_index, q)
        queries = queries.view(num_seqs, max_q, num_kv_heads, group, head_dim)

    if impl == "auto":
        impl = "flash_cpu" if q.device.type == "cpu" and _FLASH_CPU is not None else "batched"
    if impl == "flash_cpu":
        out, lse = _attend_flash_cpu(
            queries, keys, values, plan.additive_mask(q.dtype, group), scale
        )
    elif impl == "batched":
        out, lse = _attend_batched(queries, keys, values, plan.blocked, scale)
    else:
        raise ValueError(f"unknown attention impl {impl!r}; use 'auto', 'flash_cpu' or 'batched'")

    # Back to token-major: [B, max_q, Hkv, G, .] -> [B * max_q, Hq, .] -> [T, Hq, .]
    out = out.view(num_seqs * max_q, num_heads, head_dim)
    lse = lse.view(num_seqs * max_q, num_heads)
    if plan.pad_index is not None:
        out = out.index_select(0, plan.pad_index)
        lse = lse.index_select(0, plan.pad_index)
    return out, lse


# torch's fused CPU kernel; returns (out, natural-log lse). Private, so looked up defensively.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_flash_cpu(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU path. The kernel takes strided K/V, so ``keys[B, L, Hkv, D]`` is passed as the
    ``[B, Hkv, L, D]`` view without a copy; GQA folds the group into the query rows.

    ``queries [B, max_q, Hkv, G, D]``, ``keys, values [B, L, Hkv, D]``,
    ``mask [B, 1, max_q * G, L]`` -> ``(out [B, max_q, Hkv, G, D], lse [B, max_q, Hkv, G])``.
    """
    assert _FLASH_CPU is not None
    num_seqs, max_q, num_kv_heads, group, head_dim = queries.shape
    q_rows = queries.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * group, -1)
    out, lse = _FLASH_CPU(
        q_rows,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        0.0,
        False,
        attn_mask=mask,
        scale=scale,
    )
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    lse = lse.float().view(num_seqs, num_kv_heads, max_q, group).permute(0, 2, 1, 3)
    return out.contiguous(), lse.contiguous()


def _attend_batched(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocked: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any device: one batched matmul over (B, Hkv); same shapes as ``_attend_flash_cpu`` but
    ``blocked [B, max_q, 1, L]`` bool."""
    num_seqs, max_q, num_kv_heads, group, head_dim = queries.shape
    length = keys.shape[1]
    q_heads = queries.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * group, -1)
    scores = torch.matmul(q_heads, keys.permute(0, 2, 3, 1)).float().mul_(scale)
    scores = scores.view(num_seqs, num_kv_heads, max_q, group, length)
    scores.masked_fill_(blocked.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, max_q, G]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_().to(values.dtype)
    probs = probs.view(num_seqs, num_kv_heads, max_q * group, length)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, max_q * G, D]
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.contiguous(), lse.permute(0, 2, 1, 3).contiguous()


class Workspace:
    """Reused buffers for the gathered K and V, so a step does not allocate (and page-fault)
    two fresh ``[B, L, Hkv, D]`` tensors per layer."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, slot: int, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """``cache.index_select(0, block_ids)`` -> ``[len(block_ids), *cache.shape[1:]]``."""
        shape = (block_ids.shape[0], *cache.shape[1:])
        numel = math.prod(shape)
        buf = self._buffers[slot]
        if (
            buf is None
            or buf.numel() < numel
            or (buf.dtype, buf.device) != (cache.dtype, cache.device)
            # made under inference_mode it cannot be written outside it, and vice versa
            or buf.is_inference() != torch.is_inference_mode_enabled()
        ):
            buf = torch.empty(max(numel, 1), dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        out = buf[:numel].view(shape)
        torch.index_select(cache, 0, block_ids, out=out)
        return out


class TorchAttentionBackend:
    """The reference backend; caches the step plan on the identity of the metadata object."""

    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan: TorchAttentionPlan | None = None
        self._workspace = Workspace()

    write_kv = staticmethod(write_kv)  # the paged layout is the same for every backend

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._meta is not meta or self._plan is None:
            self._plan = plan_attention(meta)
            self._meta = meta
        return paged_attention(q, k_cache, v_cache, meta, scale, self._plan, self._workspace)
