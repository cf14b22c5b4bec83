"""How one paged KV block becomes the bytes a store shard holds, and back.

The paged cache (``kernels/kv_cache.py``) is, per layer, ``k_cache, v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Block ``b`` of a request is
``k_cache[b], v_cache[b]`` in every layer: 2 * num_layers contiguous *pieces* of
``piece_bytes = block_size * num_kv_heads * head_dim * itemsize`` bytes each. A stored block
is those pieces back to back in the order layer 0 K, layer 0 V, layer 1 K, ...:

    piece j = 2 * layer + (0 for K, 1 for V) lies at bytes [j * piece_bytes, (j + 1) * ...)

``copy_ops`` pairs each piece with its offset inside a remote block, so the transfer layer
moves a block between a shard's segment and a worker's cache in one copy, with no staging
buffer. ``pieces`` and ``copy_ops`` are views of host memory, so they need a CPU cache.

``gather`` and ``scatter`` take a cache on any torch device. On the CPU they copy between
the cache and the caller's bytes directly, as before (no extra copy). On another device
(CUDA) a gather collects the block's 2 * num_layers pieces into one device buffer and
copies it to host memory in one device-to-host copy; a scatter copies the host bytes to the
device in one copy and places the pieces from there. The per-layer, asynchronous path
through pinned host buffers is ``store.device_staging``. The non-CPU branch is tested on
the CPU's code path as far as the device is a parameter, and gather and scatter passed on
one GPU (tests/gpu/README.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from store.block_key import as_byte_view
from store.kv_store_errors import InvalidBlockError

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVBlockLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if min(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim) <= 0:
            raise InvalidBlockError("every KV layout dimension must be positive")

    @classmethod
    def of(cls, kv_caches: KVCaches) -> KVBlockLayout:
        """The layout of caches made by ``allocate_kv_cache``."""
        if not kv_caches:
            raise InvalidBlockError("kv_caches is empty")
        k = kv_caches[0][0]
        if k.dim() != 4:
            raise InvalidBlockError(
                f"expected [num_blocks, block_size, heads, head_dim] caches, got {tuple(k.shape)}"
            )
        _, bs, heads, dim = k.shape
        return cls(len(kv_caches), int(bs), int(heads), int(dim), k.dtype)

    @property
    def piece_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.piece_bytes

    def pieces(self, kv_caches: KVCaches, block_id: int) -> list[np.ndarray]:
        """The 2 * num_layers flat uint8 views of block ``block_id`` (no copy; CPU caches
        only: use ``gather`` / ``scatter`` for a cache on another device)."""
        self._check(kv_caches, block_id)
        device = kv_caches[0][0].device
        if device.type != "cpu":
            raise InvalidBlockError(
                f"pieces are views of host memory and the caches are on {device}; "
                "gather or scatter the block instead (store.device_staging for a pipeline)"
            )
        out = []
        for k, v in kv_caches:
            for t in (k, v):
                out.append(t[block_id].view(torch.uint8).numpy().reshape(-1))
        return out

    def copy_ops(
        self, kv_caches: KVCaches, block_id: int, remote_offset: int
    ) -> list[tuple[int, np.ndarray]]:
        """``(remote byte offset, local piece)`` pairs for the transfer layer."""
        pb = self.piece_bytes
        return [(remote_offset + j * pb, p) for j, p in enumerate(self.pieces(kv_caches, block_id))]

    def gather(
        self, kv_caches: KVCaches, block_id: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Block ``block_id`` as one flat uint8 host array of ``block_bytes`` (``out``, if
        given: any writable host buffer of that size); the caches may be on any device."""
        if out is None:
            out = np.empty(self.block_bytes, dtype=np.uint8)
        dst = as_byte_view(out)
        if dst.size != self.block_bytes:
            raise InvalidBlockError(f"out holds {dst.size} bytes, a block is {self.block_bytes}")
        if kv_caches[0][0].device.type != "cpu":
            self._gather_torch(kv_caches, block_id, dst)
            return out
        pb = self.piece_bytes
        for j, p in enumerate(self.pieces(kv_caches, block_id)):
            dst[j * pb : (j + 1) * pb] = p
        return out

    def scatter(self, data: object, kv_caches: KVCaches, block_id: int) -> None:
        """Write a stored block's bytes (host memory) into block ``block_id`` of the caches,
        which may be on any device."""
        src = as_byte_view(data)
        if src.size != self.block_bytes:
            raise InvalidBlockError(
                f"block data holds {src.size} bytes, this layout needs {self.block_bytes}"
            )
        if kv_caches[0][0].device.type != "cpu":
            self._scatter_torch(src, kv_caches, block_id)
            return
        pb = self.piece_bytes
        for j, p in enumerate(self.pieces(kv_caches, block_id)):
            p[:] = src[j * pb : (j + 1) * pb]

    # -- caches on another device (CUDA): torch copies, correct on any device ------------
    def _gather_torch(self, kv_caches: KVCaches, block_id: int, dst: np.ndarray) -> None:
        """The block's pieces collected into one buffer on the caches' device, then one copy
        into the host bytes ``dst`` (device to host)."""
        self._check(kv_caches, block_id)
        torch.from_numpy(dst).copy_(torch.cat(self._tensor_pieces(kv_caches, block_id)))

    def _scatter_torch(self, src: np.ndarray, kv_caches: KVCaches, block_id: int) -> None:
        """The host bytes ``src`` copied to the caches' device in one copy, then placed."""
        self._check(kv_caches, block_id)
        staged = _host_tensor(src).to(kv_caches[0][0].device)
        pb = self.piece_bytes
        for j, p in enumerate(self._tensor_pieces(kv_caches, block_id)):
            p.copy_(staged[j * pb : (j + 1) * pb])

    def _tensor_pieces(self, kv_caches: KVCaches, block_id: int) -> list[torch.Tensor]:
        """The 2 * num_layers flat uint8 tensor views of block ``block_id``, on the caches'
        device, in stored order (checked by the caller)."""
        return [t[block_id].view(torch.uint8).reshape(-1) for k, v in kv_caches for t in (k, v)]

    def _check(self, kv_caches: KVCaches, block_id: int) -> None:
        if KVBlockLayout.of(kv_caches) != self:
            raise InvalidBlockError(f"caches have layout {KVBlockLayout.of(kv_caches)}, not {self}")
        if not 0 <= block_id < kv_caches[0][0].shape[0]:
            raise InvalidBlockError(f"block id {block_id} is outside the cache")


def _host_tensor(src: np.ndarray) -> torch.Tensor:
    """A uint8 CPU tensor over ``src``'s bytes (no copy; read-only bytes are only read)."""
    if src.flags.writeable:
        return torch.from_numpy(src)
    with warnings.catch_warnings():  # torch warns that writing would be undefined: we read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(src)
