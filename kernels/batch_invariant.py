"""Batch-invariant forward: a token's bits do not depend on the other tokens of its step.

The default forward is exact only within rounding: CPU GEMMs pick their kernel and blocking
by the number of rows (oneDNN's fp32 linear with a 1536-wide reduction gives a row other
bits at 1 row than at 33; ``F.linear`` takes a GEMV at one row), and attention sends a
sequence's rows to the decode or the prefill kernel, or to torch's flash kernel with a
blocking chosen by the query length, depending on what else is in the step. So a prompt's
logprobs differ, in the last bits (fp32) or in whole tokens (bf16), between running alone
and inside a batch, or when chunked at other boundaries. For RL, where a trainer recomputes
the logprobs a rollout reported, that is noise (vLLM's batch-invariant mode is the anchor).

With ``EngineConfig.batch_invariant`` every row's arithmetic is fixed:

- Linear layers and the LM head (:class:`RowTiled`): the rows run through the layer in tiles
  of exactly ``TILE_ROWS`` (the last padded with zero rows), so the GEMM kernel and its
  blocking never change with the batch; measured here, a row's bits in a fixed-shape GEMM
  depend neither on its place in the tile nor on the other rows (fp32 oneDNN-packed and
  plain, bf16).
- Attention (:class:`BatchInvariantAttention`): every sequence, decode or prefill chunk,
  takes one kernel whose per-row reduction depends only on that row's visible keys. On CPU
  that is the compiled prefill kernel (``paged_prefill_cpu.cpp``: each query row's scores,
  softmax and value sum run in a fixed order over its own keys; keys past a row's diagonal
  add exact zeros), in fp32 for any model dtype (a bf16 cache is widened exactly). Elsewhere
  (another device, fp64, or no compiler) plain torch ops in fixed shapes: queries in tiles of
  ``QUERY_TILE`` rows against keys in tiles of ``KEY_TILE``, merged by an online softmax in
  key order; a key tile a row cannot see leaves its state bit for bit unchanged.

Norms, RoPE, activations, residuals and sampling are per row already. The cost is the
padding of the last tile and one GEMM call per tile (``bench/batch_invariance.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from kernels import paged_attention_cpu
from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import write_kv
from kernels.cpu_linear import PackedLinear

TILE_ROWS = 32  # rows per linear-layer GEMM call (the batch oneDNN's packed layout is tuned for)
QUERY_TILE = 16  # torch attention path: query rows per tile
KEY_TILE = 64  # torch attention path: keys per tile


def run_row_tiles(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = TILE_ROWS
) -> torch.Tensor:
    """``fn`` over ``x [rows, in]`` in calls of exactly ``tile`` rows (the last padded with
    zero rows) -> ``[rows, out]``, the rows concatenated in order."""
    rows = x.shape[0]
    pad = -rows % tile
    if pad or rows == 0:
        x = torch.cat([x, x.new_zeros(pad or tile, *x.shape[1:])])
    outs = [fn(x[start : start + tile]) for start in range(0, x.shape[0], tile)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:rows]


class RowTiled(nn.Module):
    """A linear layer (``nn.Linear`` or ``PackedLinear``) run over fixed row tiles."""

    def __init__(self, inner: nn.Module, tile: int = TILE_ROWS) -> None:
        super().__init__()
        self.inner = inner
        self.tile = tile

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.inner.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        return bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = run_row_tiles(self.inner, rows, self.tile)
        return out.view(*x.shape[:-1], out.shape[-1])


def tile_linears(module: nn.Module, tile: int = TILE_ROWS) -> int:
    """Wrap every ``nn.Linear`` and ``PackedLinear`` below ``module`` in ``RowTiled``;
    returns how many (a layer already wrapped is left as it is)."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, RowTiled):
            continue
        if isinstance(child, nn.Linear | PackedLinear):
            setattr(module, name, RowTiled(child, tile))
            count += 1
        else:
            count += tile_linears(child, tile)
    return count


def _query_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_lens [B], offsets [B])`` int64: query rows per sequence and the position of its
    first query relative to its first key."""
    q_lens = meta.query_start[1:] - meta.query_start[:-1]
    offsets = meta.query_offsets if meta.query_offsets is not None else meta.context_lens - q_lens
    return q_lens, offsets


def attend_native_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence through the compiled prefill kernel, in fp32. A cache in another dtype
    (or not contiguous) is read through a widened copy of the step's blocks."""
    q_lens, offsets = _query_layout(meta)
    tables = meta.block_tables
    if k_cache.dtype != torch.float32 or not k_cache.is_contiguous():
        num_seqs = meta.num_seqs
        width = max(math.ceil(meta.max_context_len / meta.block_size), 1)
        flat = tables[:, :width].reshape(-1)
        k_cache = k_cache.index_select(0, flat).float()
        v_cache = v_cache.index_select(0, flat).float()
        tables = torch.arange(num_seqs * width, device=flat.device).view(num_seqs, width)
    out, lse = paged_attention_cpu.paged_prefill_attention(
        q.float(), k_cache, v_cache, tables, q_lens, offsets, meta.context_lens, scale
    )
    return out.to(q.dtype), lse


def attend_tiled_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any device: per sequence, query tiles of ``QUERY_TILE`` rows against key tiles of
    ``KEY_TILE`` keys (every matmul one fixed shape), online softmax in key order, computed
    in at least fp32. ``q [T, Hq, D]`` -> ``(out [T, Hq, D], lse [T, Hq] float32)``."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    work = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=work, device=device)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=device)
    q_lens, offsets = _query_layout(meta)
    starts, lens = meta.query_start.tolist(), q_lens.tolist()
    offs, ctxs = offsets.tolist(), meta.context_lens.tolist()
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    key_index = torch.arange(KEY_TILE, device=device)
    row_index = torch.arange(QUERY_TILE, device=device).repeat_interleave(group)  # [QT * G]
    for b in range(meta.num_seqs):
        keys = max(min(offs[b] + lens[b], ctxs[b]), 0)
        if lens[b] == 0 or keys == 0:
            continue
        tiles = math.ceil(keys / KEY_TILE)
        pos = torch.arange(tiles * KEY_TILE, device=device)
        blocks = meta.block_tables[b].index_select(
            0, (pos // block_size).clamp(max=meta.block_tables.shape[1] - 1)
        )
        slots = blocks * block_size + pos % block_size
        seen = (pos < keys).view(-1, 1, 1)
        # [tiles, Hkv, D, KT] and [tiles, Hkv, KT, D]; keys past the last are zero (finite)
        k_all = torch.where(seen, k_rows.index_select(0, slots).to(work), 0.0)
        v_all = torch.where(seen, v_rows.index_select(0, slots).to(work), 0.0)
        k_all = k_all.view(tiles, KEY_TILE, num_kv_heads, head_dim).permute(0, 2, 3, 1)
        v_all = v_all.view(tiles, KEY_TILE, num_kv_heads, head_dim).transpose(1, 2)
        for r0 in range(0, lens[b], QUERY_TILE):
            rows = min(QUERY_TILE, lens[b] - r0)
            first = starts[b] + r0
            q_tile = torch.zeros(QUERY_TILE, num_heads, head_dim, dtype=work, device=device)
            q_tile[:rows] = q[first : first + rows]
            # [Hkv, QT * G, D]: row i * G + g is query i, head kv * G + g
            q_heads = q_tile.view(QUERY_TILE, num_kv_heads, group, head_dim).transpose(0, 1)
            q_heads = q_heads.reshape(num_kv_heads, QUERY_TILE * group, head_dim)
            q_pos = offs[b] + r0 + row_index  # [QT * G]
            limit = torch.clamp(q_pos + 1, max=ctxs[b])  # keys each row sees
            top = torch.full(
                (num_kv_heads, QUERY_TILE * group), -math.inf, dtype=work, device=device
            )
            total = torch.zeros_like(top)
            acc = torch.zeros(num_kv_heads, QUERY_TILE * group, head_dim, dtype=work, device=device)
            needed = math.ceil(max(min(offs[b] + r0 + rows, ctxs[b]), 0) / KEY_TILE)
            for j in range(needed):
                scores = torch.matmul(q_heads, k_all[j]).mul_(scale)  # [Hkv, QT * G, KT]
                hidden = (j * KEY_TILE + key_index)[None, :] >= limit[:, None]  # [QT * G, KT]
                scores.masked_fill_(hidden, -math.inf)
                new_top = torch.maximum(top, scores.amax(-1))
                safe = torch.where(torch.isinf(new_top), 0.0, new_top)
                alpha = torch.exp(top - safe)
                probs = torch.exp(scores - safe.unsqueeze(-1))
                total = total * alpha + probs.sum(-1)
                acc = acc * alpha.unsqueeze(-1) + torch.matmul(probs, v_all[j])
                top = new_top
            sums = torch.where(total > 0, total, 1.0)
            tile_out = (acc / sums.unsqueeze(-1)).view(num_kv_heads, QUERY_TILE, group, head_dim)
            tile_lse = (top + torch.log(total)).view(num_kv_heads, QUERY_TILE, group)
            out[first : first + rows] = tile_out.transpose(0, 1).reshape(
                QUERY_TILE, num_heads, head_dim
            )[:rows]
            lse[first : first + rows] = (
                tile_lse.transpose(0, 1).reshape(QUERY_TILE, num_heads)[:rows].float()
            )
    return out.to(q.dtype), lse


class BatchInvariantAttention:
    """The attention backend of a batch-invariant engine (see the module docstring).

    ``native=False`` takes the torch path on CPU too (for tests and comparison)."""

    name = "batch_invariant"

    def __init__(self, native: bool = True) -> None:
        self.native = native

    write_kv = staticmethod(write_kv)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self.native
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and paged_attention_cpu.load() is not None
        ):
            return attend_native_cpu(q, k_cache, v_cache, meta, scale)
        return attend_tiled_torch(q, k_cache, v_cache, meta, scale)
