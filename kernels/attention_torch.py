"""Paged attention in plain torch: the reference backend, CPU and GPU.

A step's sequences are split into groups that are computed apart, so decode rows (one query
each) and prefill chunks are never padded to one another, as serving kernels (flashinfer,
vLLM) run them. The plan sorts the sequences by (query length, context length) and cuts that
order greedily wherever padding the next sequence into the current group would cost more
than a group of its own: all decodes of a step usually form one group (padded to the longest
decode context), each long chunk runs alone, and short chunks of similar size run together.

Within a group, each sequence's KV is gathered through its block table into a padded
``[n, L, Hkv, D]`` tensor (``L`` = the group's longest context, rounded up to whole blocks;
a lone sequence whose blocks are consecutive in the cache is read in place, without a copy),
queries are padded to ``[n, max_q, Hq, D]``, and a masked matmul-softmax-matmul runs for the
whole group (on CPU torch's fused flash-attention kernel, which reads the gathered KV in place
and returns the log-sum-exp; elsewhere a plain batched matmul). GQA never repeats KV: query
head ``h`` is served by KV head ``h // group`` (the Hugging Face ``repeat_kv`` convention), so
queries are regrouped as ``[n, max_q, Hkv, group, D]``.

On CPU in fp32 every group goes to a compiled kernel instead (``kernels/paged_attention_cpu.py``):
decode rows to one that reads each sequence's blocks where they lie, not gathered; prefill
chunks to one that copies each sequence's visible keys out of their blocks once and skips
the keys above the causal diagonal. Where they cannot be built, the gathered path above
serves.

``split=False`` keeps the former single padded group (``[B, max_q, L]`` over the whole step),
for comparison (``bench/mixed_step.py --compare-padded``).

A fixed-shape decode step (``FixedDecodeMetadata``, a CUDA-graph bucket) takes neither the
plan nor the workspace: ``fixed_decode_attention`` reads nothing on the host, so it can be
captured. On fp32 CPU it is the compiled decode kernel; elsewhere every sequence gathers all
``W`` blocks of its fixed-width table and the keys at or past its context length are masked
(work grows with ``W``, which is why the runner picks the narrowest power-of-two width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels import paged_attention_cpu
from kernels.attention_metadata import AttentionMetadata, FixedDecodeMetadata

# Grouping cost model, in units of one (query row, key) pair over all heads. A group costs a
# fixed overhead (the kernel calls and index work of one group, per layer) plus its padded
# work ``n * L * (max_q + GATHER_COST)``: every padded query row is computed against every
# padded key, and each gathered key is copied once (about as dear as a few query rows).
GROUP_OVERHEAD = 4096
GATHER_COST = 4


@dataclass
class AttentionGroup:
    """Sequences computed together, padded to ``[n, max_q]`` queries and ``L`` keys."""

    num_seqs: int  # n
    max_q: int
    num_blocks: int  # nb, so L = nb * block_size
    flat_block_ids: torch.Tensor  # [n * nb] int64, the blocks of each sequence in order
    # [n] int64 keys each sequence's one query sees (its first ones); None unless max_q == 1
    visible: torch.Tensor | None
    q_lens: torch.Tensor  # [n] int64 query rows of each sequence
    offsets: torch.Tensor  # [n] int64 position of each sequence's first query row
    context_lens: torch.Tensor  # [n] int64 keys cached for each sequence
    # one sequence whose queries are its whole context (a fresh prompt): row i sees keys 0..i
    whole_prompt: bool
    first_block: int | None  # n == 1 and consecutive blocks: read the cache in place
    blocked: torch.Tensor  # [n, max_q, 1, L] bool: query row i of a sequence must NOT see key j
    # [Tg] int64 rows of the step's tokens this group computes; None: all T rows, in order
    token_rows: torch.Tensor | None
    # [Tg] int64 row of each of those tokens in the padded [n * max_q]; None: no padding
    pad_index: torch.Tensor | None
    _masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """``[n, 1, max_q * group, L]``: 0 where visible, -inf where blocked; query row
        ``i * group + g`` is query i, group member g. Built once per step and dtype."""
        key = (dtype, group)
        if key not in self._masks:
            num_seqs, max_q, _, length = self.blocked.shape
            blocked = self.blocked.expand(num_seqs, max_q, group, length)
            blocked = blocked.reshape(num_seqs, 1, max_q * group, length)
            mask = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
            self._masks[key] = mask.masked_fill_(blocked, float("-inf"))
        return self._masks[key]


@dataclass
class TorchAttentionPlan:
    """Per-step index work shared by every layer of the step."""

    groups: list[AttentionGroup]
    num_tokens: int


def _group_cost(num_seqs: int, max_q: int, max_ctx: int, block_size: int) -> int:
    length = max(math.ceil(max_ctx / block_size), 1) * block_size
    return GROUP_OVERHEAD + num_seqs * length * (max_q + GATHER_COST)


def group_sequences(
    query_lens: list[int], context_lens: list[int], block_size: int
) -> list[list[int]]:
    """Sequence indices per group: sorted by (query length, context length), cut greedily
    where one more sequence costs more padded than alone (see ``GROUP_OVERHEAD``)."""
    order = sorted(range(len(query_lens)), key=lambda b: (query_lens[b], context_lens[b]))
    groups: list[list[int]] = []
    max_q = max_ctx = cost = 0
    for b in order:
        q, ctx = query_lens[b], context_lens[b]
        if groups:
            grown = _group_cost(len(groups[-1]) + 1, max(max_q, q), max(max_ctx, ctx), block_size)
            if grown <= cost + _group_cost(1, q, ctx, block_size):
                groups[-1].append(b)
                max_q, max_ctx, cost = max(max_q, q), max(max_ctx, ctx), grown
                continue
        groups.append([b])
        max_q, max_ctx, cost = q, ctx, _group_cost(1, q, ctx, block_size)
    return groups


def plan_attention(meta: AttentionMetadata, split: bool = True) -> TorchAttentionPlan:
    """Index tensors for one step; cost is independent of the number of layers."""
    device = meta.context_lens.device
    num_seqs = meta.num_seqs
    num_tokens = int(meta.slot_mapping.shape[0])
    starts = meta.query_start.tolist()
    query_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
    ctx_list = meta.context_lens.tolist()
    if split:
        members = group_sequences(query_lens, ctx_list, meta.block_size)
    else:
        members = [list(range(num_seqs))] if num_seqs else []
    groups = []
    for seqs in members:
        in_order = seqs == list(range(num_seqs))
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        groups.append(
            _plan_group(meta, seqs, index, query_lens, ctx_list, starts, num_tokens, in_order)
        )
    return TorchAttentionPlan(groups, num_tokens)


def _plan_group(
    meta: AttentionMetadata,
    seqs: list[int],
    index: torch.Tensor,
    query_lens: list[int],
    ctx_list: list[int],
    starts: list[int],
    num_tokens: int,
    in_order: bool,
) -> AttentionGroup:
    device = index.device
    n = len(seqs)
    max_q = max(max(query_lens[b] for b in seqs), 1)
    max_ctx = max(ctx_list[b] for b in seqs)
    nb = max(math.ceil(max_ctx / meta.block_size), 1)
    if meta.block_tables.shape[1] < nb:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[1]} columns but context length "
            f"{max_ctx} needs {nb} blocks of {meta.block_size}"
        )
    length = nb * meta.block_size
    tables = meta.block_tables[:, :nb] if in_order else meta.block_tables.index_select(0, index)
    tables = tables[:, :nb]
    first_block = None
    if n == 1:
        ids = tables[0].tolist()
        if ids == list(range(ids[0], ids[0] + nb)):
            first_block = ids[0]
    ctx = meta.context_lens if in_order else meta.context_lens.index_select(0, index)
    q_lens = torch.tensor([query_lens[b] for b in seqs], dtype=torch.int64, device=device)
    if meta.query_offsets is None:
        offsets = ctx - q_lens
    else:
        offsets = meta.query_offsets if in_order else meta.query_offsets.index_select(0, index)
    rows = torch.arange(max_q, device=device)  # [max_q]
    keys = torch.arange(length, device=device)  # [L]
    # Position of query row i of each sequence; rows past its query length are padding.
    q_pos = offsets[:, None] + rows[None, :]  # [n, max_q]
    blocked = (keys[None, None, :] > q_pos[:, :, None]) | (
        keys[None, None, :] >= ctx[:, None, None]
    )
    group_tokens = sum(query_lens[b] for b in seqs)
    # Token j of the group is query ``within[j]`` of its sequence.
    first_row = torch.cumsum(q_lens, 0) - q_lens  # [n] first group row of each sequence
    within = torch.arange(group_tokens, device=device) - first_row.repeat_interleave(
        q_lens, output_size=group_tokens
    )
    token_rows = None
    if not (in_order and group_tokens == num_tokens):
        seq_starts = torch.tensor([starts[b] for b in seqs], dtype=torch.int64, device=device)
        token_rows = seq_starts.repeat_interleave(q_lens, output_size=group_tokens) + within
    whole_prompt = (
        n == 1 and max_q > 1 and meta.query_offsets is None and query_lens[seqs[0]] == max_ctx
    )
    visible = None
    if max_q == 1 and group_tokens == n:  # decode rows: query i = 0 sees keys 0..offset
        visible = torch.minimum(offsets + 1, ctx).clamp_(min=0)
    pad_index = None
    if max_q > 1 or group_tokens != n:
        pad_starts = torch.arange(n, device=device) * max_q
        pad_index = pad_starts.repeat_interleave(q_lens, output_size=group_tokens) + within
    return AttentionGroup(
        num_seqs=n,
        max_q=max_q,
        num_blocks=nb,
        flat_block_ids=tables.reshape(-1),
        visible=visible,
        q_lens=q_lens,
        offsets=offsets,
        context_lens=ctx,
        whole_prompt=whole_prompt,
        first_block=first_block,
        blocked=blocked.view(n, max_q, 1, length),
        token_rows=token_rows,
        pad_index=pad_index,
    )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``k_cache[slot // bs, slot % bs] = k[t]`` for every token t (and the same for v).

    The engine holds its KV cache in the model's dtype, so ``k`` and ``v`` are stored as
    they are; a cache of another dtype (a test's) gets them cast."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def fixed_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    impl: str = "auto",
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row, nothing read on the host (capturable in a CUDA graph): ``q [B, Hq,
    D]``, ``block_tables [B, W]``, ``context_lens [B]`` (row b sees its keys ``0 ..
    context_lens[b] - 1``, every one at least 1) -> ``(out [B, Hq, D], lse [B, Hq] float32)``.
    ``key_mask [B, W * block_size]``: ``FixedDecodeMetadata.key_mask``, made once per step
    (None: made here).

    ``impl``: "native_cpu" (the compiled decode kernel, fp32 CPU), "batched" (gather the
    ``W`` blocks of every row, mask, one batched matmul-softmax-matmul; any device) or
    "auto" (the first on fp32 CPU where it is built, else "batched")."""
    if impl == "auto":
        impl = "native_cpu" if _auto_impl(q, k_cache) == "native_cpu" else "batched"
    if impl == "native_cpu":
        return paged_attention_cpu.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale
        )
    if impl != "batched":
        raise ValueError(f"unknown fixed decode impl {impl!r}; use 'auto', 'native_cpu', 'batched'")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    length = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1)
    kv_shape = (num_seqs, length, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, flat).view(kv_shape)
    values = v_cache.index_select(0, flat).view(kv_shape)
    queries = q.reshape(num_seqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if key_mask is None:
        key_mask = torch.arange(length, device=q.device)[None, :] >= context_lens[:, None]
    blocked = key_mask.view(num_seqs, 1, 1, length)
    out, lse = _attend_batched(queries, keys, values, blocked, scale)
    return out.view(num_seqs, num_heads, head_dim), lse.view(num_seqs, num_heads)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    plan: TorchAttentionPlan | None = None,
    workspace: Workspace | None = None,
    impl: str = "auto",
    split: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [T, Hq, D]`` -> ``(out [T, Hq, D], lse [T, Hq] float32, natural log)``.

    ``impl``: "native_cpu" (the compiled decode and prefill kernels, fp32 CPU only),
    "flash_cpu" (torch's fused CPU flash-attention kernel over the gathered KV), "batched"
    (plain matmul-softmax-matmul, any device) or "auto" (on CPU the first that runs here,
    elsewhere "batched").
    ``split``: compute groups of similar sequences apart (default) or pad the whole step to
    one ``[B, max_q, L]`` group (the former path); ignored when ``plan`` is given.
    """
    if plan is None:
        plan = plan_attention(meta, split)
    if workspace is None:
        workspace = Workspace()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if impl == "auto":
        impl = _auto_impl(q, k_cache)
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; use 'auto' or one of {_IMPLS}")
    if len(plan.groups) == 1 and plan.groups[0].token_rows is None:
        return _attend_group(q, k_cache, v_cache, plan.groups[0], scale, workspace, impl)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    for group in plan.groups:
        rows = group.token_rows
        assert rows is not None
        g_out, g_lse = _attend_group(
            q.index_select(0, rows), k_cache, v_cache, group, scale, workspace, impl
        )
        out.index_copy_(0, rows, g_out)
        lse.index_copy_(0, rows, g_lse)
    return out, lse


def _attend_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    workspace: Workspace,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [Tg, Hq, D]``, the group's tokens in group order -> ``(out, lse)`` likewise."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    n, max_q, nb = group.num_seqs, group.max_q, group.num_blocks
    if impl == "native_cpu":
        tables = group.flat_block_ids.view(n, nb)
        if group.visible is not None:
            return paged_attention_cpu.paged_decode_attention(
                q, k_cache, v_cache, tables, group.visible, scale
            )
        return paged_attention_cpu.paged_prefill_attention(
            q, k_cache, v_cache, tables, group.q_lens, group.offsets, group.context_lens, scale
        )
    gqa = num_heads // num_kv_heads
    kv_shape = (n, nb * block_size, num_kv_heads, head_dim)  # [n, L, Hkv, D]
    if group.first_block is not None:  # one sequence, consecutive blocks: no copy
        first = group.first_block
        keys = k_cache[first : first + nb].view(kv_shape)
        values = v_cache[first : first + nb].view(kv_shape)
    else:
        keys = workspace.gather(0, k_cache, group.flat_block_ids).view(kv_shape)
        values = workspace.gather(1, v_cache, group.flat_block_ids).view(kv_shape)
    if group.whole_prompt and impl in ("flash_cpu", "native_cpu"):
        return _attend_prompt_flash_cpu(q, keys[0], values[0], scale)

    # Queries: [Tg, Hq, D] -> [n, max_q, Hkv, G, D]
    if group.pad_index is None:
        queries = q.reshape(n, 1, num_kv_heads, gqa, head_dim)
    else:
        queries = q.new_zeros(n * max_q, num_heads, head_dim)
        queries.index_copy_(0, group.pad_index, q)
        queries = queries.view(n, max_q, num_kv_heads, gqa, head_dim)

    if impl in ("flash_cpu", "native_cpu"):
        out, lse = _attend_flash_cpu(
            queries, keys, values, group.additive_mask(q.dtype, gqa), scale
        )
    else:
        out, lse = _attend_batched(queries, keys, values, group.blocked, scale)

    # Back to token-major: [n, max_q, Hkv, G, .] -> [n * max_q, Hq, .] -> [Tg, Hq, .]
    out = out.view(n * max_q, num_heads, head_dim)
    lse = lse.view(n * max_q, num_heads)
    if group.pad_index is not None:
        out = out.index_select(0, group.pad_index)
        lse = lse.index_select(0, group.pad_index)
    return out, lse


# torch's fused CPU kernel; returns (out, natural-log lse). Private, so looked up defensively.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_IMPLS = ("native_cpu", "flash_cpu", "batched")


def _auto_impl(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if q.device.type != "cpu" or _FLASH_CPU is None:
        return "batched"
    fp32 = q.dtype == k_cache.dtype == torch.float32
    if fp32 and k_cache.is_contiguous() and paged_attention_cpu.load() is not None:
        return "native_cpu"
    return "flash_cpu"


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


def _attend_prompt_flash_cpu(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh prompt, causal without a mask, so the kernel skips the blocks above the
    diagonal (about half the work of the masked path): ``q [T, Hq, D]``, ``keys, values
    [L, Hkv, D]`` with ``L >= T`` -> ``(out [T, Hq, D], lse [T, Hq])``. The kernel's causal
    mask is top-left aligned, so query i sees keys 0..i and keys past T are never read. KV
    heads are repeated to the query heads (``[Hq, L, D]``, query head h reads KV head
    ``h // group``): a causal mask needs one query position per row, not GQA-folded rows."""
    assert _FLASH_CPU is not None
    group = q.shape[1] // keys.shape[1]
    k_heads = keys.transpose(0, 1)  # [Hkv, L, D]
    v_heads = values.transpose(0, 1)
    if group > 1:
        k_heads = k_heads.repeat_interleave(group, dim=0)  # [Hq, L, D]
        v_heads = v_heads.repeat_interleave(group, dim=0)
    out, lse = _FLASH_CPU(
        q.transpose(0, 1).unsqueeze(0),
        k_heads.unsqueeze(0),
        v_heads.unsqueeze(0),
        0.0,
        True,
        scale=scale,
    )
    return out[0].transpose(0, 1).contiguous(), lse[0].float().t().contiguous()


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
    # scores in at least fp32 (bf16 softmax loses too much), fp64 kept for fp64 models
    score_dtype = torch.promote_types(queries.dtype, torch.float32)
    scores = torch.matmul(q_heads, keys.permute(0, 2, 3, 1)).to(score_dtype).mul_(scale)
    scores = scores.view(num_seqs, num_kv_heads, max_q, group, length)
    scores.masked_fill_(blocked.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, max_q, G]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_().to(values.dtype)
    probs = probs.view(num_seqs, num_kv_heads, max_q * group, length)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, max_q * G, D]
    out = out.view(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.contiguous(), lse.float().permute(0, 2, 1, 3).contiguous()


class Workspace:
    """Reused buffers for the gathered K and V, so a step does not allocate (and page-fault)
    two fresh ``[n, L, Hkv, D]`` tensors per group and layer. Groups of one step run one after
    another, so they share the buffers."""

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
    """The reference backend; caches the step plan on the identity of the metadata object.

    ``split=False``: the former path, one padded group per step (for comparison only)."""

    name = "torch"
    graph_safe_decode = True  # FixedDecodeMetadata steps read nothing on the host

    def __init__(self, split: bool = True) -> None:
        self.split = split
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
        if isinstance(meta, FixedDecodeMetadata):  # no plan: nothing read on the host
            length = int(meta.block_tables.shape[1]) * k_cache.shape[1]
            return fixed_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                key_mask=meta.key_mask(length),
            )
        if self._meta is not meta or self._plan is None:
            self._plan = plan_attention(meta, self.split)
            self._meta = meta
        return paged_attention(q, k_cache, v_cache, meta, scale, self._plan, self._workspace)
