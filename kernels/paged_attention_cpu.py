"""The CPU attention kernels, built on first use, then cached: decode rows
(``paged_decode_cpu.cpp``) and prefill chunks (``paged_prefill_cpu.cpp``), fp32.

Decode rows (one query each) are most of a serving step's attention. The torch path gathers
each sequence's K and V blocks into a padded copy before its kernel reads them, so every
cached byte is copied once and read twice; the decode kernel reads each block where it lies.
Prefill chunks are causal: torch's fused CPU kernel computes a masked 256-token prompt at
about the cost of an unmasked one, while the prefill kernel skips the keys above the
diagonal. Both are compiled into one module with the machine's C++ compiler through
``torch.utils.cpp_extension`` (about 30 s here the first time; later processes load the
cached build, about 1 s). Where it cannot be built, :func:`load` says why and the torch path
is used.
``MERIDIAN_CPU_ATTENTION_KERNELS=0`` turns them off.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_build import CompiledExtension

_HERE = Path(__file__).parent
EXTENSION = CompiledExtension(
    "meridian_paged_attention_cpu",
    [
        _HERE / "cpu_attention_bindings.cpp",
        _HERE / "paged_decode_cpu.cpp",
        _HERE / "paged_prefill_cpu.cpp",
    ],
    [_HERE / "cpu_math.h"],
    switch="MERIDIAN_CPU_ATTENTION_KERNELS",
)


def load() -> ModuleType | None:
    """The built module (both kernels), or None; see :func:`error`."""
    return EXTENSION.load()


def error() -> str | None:
    """Why the kernels are not in use, once :func:`load` has been tried; None if they are."""
    return EXTENSION.error()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [n, Hq, D]`` fp32, caches ``[num_blocks, block_size, Hkv, D]``, ``block_tables
    [n, W]`` int64, ``visible [n]`` int64 (query b sees keys ``0..visible[b]-1``) ->
    ``(out [n, Hq, D], lse [n, Hq] float32)``. Raises RuntimeError if the kernel is not built."""
    out, lse = EXTENSION.require().paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), visible.contiguous(), scale
    )
    return out, lse


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_lens: torch.Tensor,
    offsets: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]`` fp32: the query rows of n sequences one after another (``q_lens[b]``
    each); caches ``[num_blocks, block_size, Hkv, D]``; ``block_tables [n, W]``, ``q_lens,
    offsets, context_lens [n]`` int64. Query i of sequence b is at position ``offsets[b] + i``
    and sees keys ``j < min(offsets[b] + i + 1, context_lens[b])`` -> ``(out [T, Hq, D], lse
    [T, Hq] float32)``. Raises RuntimeError if the kernels are not built."""
    out, lse = EXTENSION.require().paged_prefill_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables.contiguous(),
        q_lens.contiguous(),
        offsets.contiguous(),
        context_lens.contiguous(),
        scale,
    )
    return out, lse
