"""A pure-decode step's inputs padded to its bucket: ``B`` live rows, ``N - B`` padded ones.

Rows ``0..B-1`` keep the step's token ids, positions, context lengths, slot mapping and
block tables (cut or widened to the fixed width ``W``); the padded rows ``B..N-1`` are
token 0 at position 0 with context length 1, every table entry and their slot in the
scratch block.

The invariant that makes padding safe: **a padded row writes its K/V only into the scratch
block and reads only from it.** The scratch block is a block of the worker's KV cache that
no request is ever given (the controller builder gives the KV manager's pool one block
fewer than the cache holds; ``actors/engine/controller_builder.py``), so no live
sequence's KV changes and no live row sees a padded row's keys. Several padded rows may
write the same scratch slot in one step (which one lands is unspecified, and does not
matter: only padded rows read it, and their outputs are discarded). A padded row sees one
key (its own position 0), so its attention never softmaxes an empty row.

Live rows' table columns past their context are never read (masked by the context length);
those past the step's table are filled with the scratch block so every entry is a valid
block id. Works on tensors of any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata, FixedDecodeMetadata


@dataclass
class PaddedDecode:
    """A decode step at its bucket's shape (every tensor has ``N`` rows)."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    context_lens: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [N, W] int64
    slot_mapping: torch.Tensor  # [N] int64
    num_live: int  # B: rows 0..B-1 are the step's sequences, the rest padding


def scratch_slot(scratch_block: int, block_size: int) -> int:
    """The slot every padded row writes: the first of the scratch block."""
    return scratch_block * block_size


def is_pure_decode(meta: AttentionMetadata, num_tokens: int) -> bool:
    """One query token per sequence, queries the newest tokens (no KV-parallel offsets);
    decided from host values only."""
    return (
        num_tokens == meta.num_seqs
        and meta.max_query_len == 1
        and meta.query_offsets is None
        and num_tokens > 0
    )


def pad_decode(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    bucket: int,
    width: int,
    scratch_block: int,
) -> PaddedDecode:
    """``input_ids, positions [B]`` and the step's ``meta`` (pure decode, ``B <= bucket``;
    every context within ``width`` blocks) -> the step padded to ``bucket`` rows and
    ``width`` table columns (see the module docstring), on the inputs' device."""
    live = int(input_ids.shape[0])
    if not is_pure_decode(meta, live):
        raise ValueError("only a pure-decode step (one query token per sequence) is padded")
    if live > bucket:
        raise ValueError(f"{live} sequences do not fit a bucket of {bucket}")
    if -(-meta.max_context_len // meta.block_size) > width:
        raise ValueError(
            f"a context of {meta.max_context_len} tokens needs more than {width} blocks "
            f"of {meta.block_size}"
        )
    out = padding_rows(bucket, width, scratch_block, meta.block_size, input_ids.device)
    out.input_ids[:live] = input_ids
    out.positions[:live] = positions
    out.context_lens[:live] = meta.context_lens
    cols = min(width, int(meta.block_tables.shape[1]))
    out.block_tables[:live, :cols] = meta.block_tables[:, :cols]
    out.slot_mapping[:live] = meta.slot_mapping
    out.num_live = live
    return out


def padding_rows(
    bucket: int,
    width: int,
    scratch_block: int,
    block_size: int,
    device: torch.device | str = "cpu",
) -> PaddedDecode:
    """A step of ``bucket`` padded rows and no live one (what a graph's warm-up and capture
    run: by the invariant above they touch only the scratch block)."""
    slot = scratch_slot(scratch_block, block_size)
    return PaddedDecode(
        input_ids=torch.zeros(bucket, dtype=torch.int64, device=device),
        positions=torch.zeros(bucket, dtype=torch.int64, device=device),
        context_lens=torch.ones(bucket, dtype=torch.int64, device=device),
        block_tables=torch.full((bucket, width), scratch_block, dtype=torch.int64, device=device),
        slot_mapping=torch.full((bucket,), slot, dtype=torch.int64, device=device),
        num_live=0,
    )


def fixed_metadata(
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    block_size: int,
) -> FixedDecodeMetadata:
    """The metadata of a fixed-shape decode step over these (static) tensors: ``query_start
    = arange(N + 1)``; ``max_context_len`` is the table's capacity, not a value read."""
    return FixedDecodeMetadata(
        query_start=query_start,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        block_size=block_size,
        max_query_len=1,
        max_context_len=int(block_tables.shape[1]) * block_size,
    )
