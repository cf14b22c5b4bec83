"""Attention backends behind one name: "torch" (CPU and GPU, the reference) and "flashinfer".

A backend module is imported only when its name is picked, so CPU-only installs never import
flashinfer. Every backend implements :class:`AttentionBackend`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.attention_metadata import AttentionMetadata
from policies.registry import Lazy, Registry


class AttentionBackend(Protocol):
    """Paged attention over ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``.

    Metadata is treated as immutable: a backend may cache per-step work keyed on the identity
    of ``meta`` (every layer of one step passes the same object), so build a new
    ``AttentionMetadata`` for each step instead of mutating one in place.
    """

    name: str

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``k, v: [T, Hkv, D]`` at ``slot_mapping: [T]`` (in place)."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q: [T, Hq, D]`` -> ``(out [T, Hq, D] in q.dtype, lse [T, Hq] float32)``.

        Query token t of sequence b at position p attends to the cached keys at positions
        ``0..p`` of b. ``lse`` is the natural-log log-sum-exp of the scaled scores
        ``scale * q.k`` over those keys (base e, as ``torch.logsumexp``).
        """
        ...


# name -> backend class, imported when first picked.
ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend")
ATTENTION_BACKENDS.add("torch", Lazy("kernels.attention_torch", "TorchAttentionBackend"))
ATTENTION_BACKENDS.add(
    "flashinfer",
    Lazy(
        "kernels.attention_flashinfer",
        "FlashInferAttentionBackend",
        hint="install it (`pip install flashinfer-python`, CUDA only) "
        "or use attention_backend='torch'",
    ),
)


def available_backends() -> list[str]:
    return sorted(ATTENTION_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend instance for ``name``; raises ValueError naming the known backends,
    ImportError saying what to install when its package is missing."""
    return ATTENTION_BACKENDS.get(name)()
