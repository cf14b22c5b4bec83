"""Validation shared by the store: block hashes and the bytes of a block.

A block hash is a 64-bit unsigned int (``store.hashing``). A block's payload is any
C-contiguous buffer (bytes, bytearray, memoryview, numpy array, CPU torch tensor); the store
sees it as a flat ``uint8`` view of ``nbytes`` bytes and never keeps a reference to it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from store.kv_store_errors import InvalidBlockError

MAX_HASH = (1 << 64) - 1


def check_block_hash(block_hash: Any) -> int:
    """``block_hash`` as an int, or InvalidBlockError saying why it is not one."""
    if isinstance(block_hash, bool) or not isinstance(block_hash, (int, np.integer)):
        raise InvalidBlockError(
            f"block hash must be an int from store.hashing, got {type(block_hash).__name__}"
        )
    value = int(block_hash)
    if not 0 <= value <= MAX_HASH:
        raise InvalidBlockError(f"block hash {value} is outside the 64-bit unsigned range")
    return value


def as_byte_view(data: Any) -> np.ndarray:
    """A flat read-only-or-writable ``uint8`` numpy view of ``data`` (no copy).

    Accepts bytes-like objects, numpy arrays and CPU torch tensors; raises InvalidBlockError
    for anything else, for non-contiguous arrays and for empty data.
    """
    if type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1:  # fast path
        if data.flags.c_contiguous and data.size:
            return data
    if hasattr(data, "detach") and hasattr(data, "numpy"):  # a torch tensor
        if getattr(data, "device", None) is not None and str(data.device) != "cpu":
            raise InvalidBlockError("block data must be in CPU memory; copy it to host first")
        if not data.is_contiguous():
            raise InvalidBlockError("block data must be contiguous; call .contiguous() first")
        import torch  # present: data is a tensor

        # as bytes first: numpy has no bfloat16 (or float8) to view the tensor as
        tensor = data.detach() if data.dim() else data.detach().reshape(1)
        view: np.ndarray = tensor.view(torch.uint8).numpy().reshape(-1)
        if view.size == 0:
            raise InvalidBlockError("block data is empty")
        return view
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidBlockError("block data must be C-contiguous; use np.ascontiguousarray")
        view = data.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(data)
        except TypeError:
            raise InvalidBlockError(
                f"block data must be bytes-like, a numpy array or a CPU tensor, got "
                f"{type(data).__name__}"
            ) from None
        if not mv.c_contiguous:
            raise InvalidBlockError("block data must be a contiguous buffer")
        view = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if view.size == 0:
        raise InvalidBlockError("block data is empty")
    return view


def address_of(view: np.ndarray) -> int:
    """The address of a flat uint8 view's first byte (cheap for writable views)."""
    if view.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(view.data))
    return int(view.__array_interface__["data"][0])
