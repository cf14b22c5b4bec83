"""``KVBlockLayout.gather`` / ``scatter`` with the caches' device as a parameter: the CPU
always (its zero-copy path, and the torch path a CUDA cache takes, run here on CPU tensors);
CUDA when this machine has it (skipped otherwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from store.kv_block_layout import KVBlockLayout
from store.kv_store_errors import InvalidBlockError

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 4, 2, 8

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


def caches_on(device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BS, HEADS, DIM)
    return [
        (
            torch.randn(shape, generator=g).to(dtype).to(device),
            torch.randn(shape, generator=g).to(dtype).to(device),
        )
        for _ in range(LAYERS)
    ]


def expected_block(caches, block_id: int) -> np.ndarray:
    """The stored order, built independently: layer 0 K, layer 0 V, layer 1 K, ..."""
    parts = [
        t[block_id].cpu().contiguous().view(torch.uint8).reshape(-1) for kv in caches for t in kv
    ]
    return torch.cat(parts).numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_gives_host_bytes_in_stored_order_and_scatter_writes_them_back(device, dtype):
    caches = caches_on(device, dtype)
    layout = KVBlockLayout.of(caches)
    got = layout.gather(caches, 4)
    assert isinstance(got, np.ndarray) and got.size == layout.block_bytes
    assert np.array_equal(got, expected_block(caches, 4))

    other = caches_on(device, dtype, seed=1)
    layout.scatter(bytes(got), other, 1)  # read-only host bytes are accepted
    assert np.array_equal(layout.gather(other, 1), got)
    for b in (0, 2, 3, 5):  # nothing else moved
        assert np.array_equal(
            layout.gather(other, b), expected_block(caches_on(device, dtype, 1), b)
        )

    out = np.zeros(layout.block_bytes, dtype=np.uint8)
    assert layout.gather(caches, 4, out) is out and np.array_equal(out, got)


def test_the_torch_path_a_device_cache_takes_gives_the_same_bytes_on_cpu():
    caches = caches_on("cpu", torch.float32)
    layout = KVBlockLayout.of(caches)
    dst = np.zeros(layout.block_bytes, dtype=np.uint8)
    layout._gather_torch(caches, 2, dst)
    assert np.array_equal(dst, layout.gather(caches, 2))
    other = caches_on("cpu", torch.float32, seed=3)
    layout._scatter_torch(dst, other, 5)
    assert np.array_equal(layout.gather(other, 5), dst)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_blocks_and_sizes_are_refused_on_every_device(device):
    caches = caches_on(device, torch.float32)
    layout = KVBlockLayout.of(caches)
    with pytest.raises(InvalidBlockError, match="outside the cache"):
        layout.gather(caches, BLOCKS)
    with pytest.raises(InvalidBlockError, match="this layout needs"):
        layout.scatter(np.zeros(layout.block_bytes - 1, dtype=np.uint8), caches, 0)
    wrong = KVBlockLayout(LAYERS, BS, HEADS, DIM + 1)
    with pytest.raises(InvalidBlockError, match="caches have layout"):
        wrong.gather(caches, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pieces_of_a_device_cache_say_to_gather_instead():
    caches = caches_on("cuda", torch.float32)
    with pytest.raises(InvalidBlockError, match="gather or scatter"):
        KVBlockLayout.of(caches).pieces(caches, 0)
