"""Allocation of the paged KV cache: one (k_cache, v_cache) pair per layer.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (flashinfer's NHD), so a
slot ``block_id * block_size + offset`` is one row of ``cache.view(-1, num_kv_heads, head_dim)``.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled caches (zeros keep never-written slots finite for the masked torch path)."""
    if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
        raise ValueError("every KV cache dimension must be positive")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block index costs across all layers, K and V together."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
