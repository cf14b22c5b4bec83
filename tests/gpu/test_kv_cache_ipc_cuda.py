"""KV on the device through the KV path, on CUDA (skipped without CUDA): a decode process's
cache exported as CUDA IPC handles (``store.kv_cache_ipc``) and written block by block from a
second, spawned process on the same GPU; a block gathered from and scattered into a CUDA
cache (``KVBlockLayout``); a prefill's layers staged through pinned buffers into a store
shard's DRAM tier (``store.device_staging``). Plain processes, no Ray."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import numpy as np
import pytest
import torch

from store.device_staging import DeviceStaging
from store.kv_block_layout import KVBlockLayout
from store.kv_cache_ipc import KVCacheExporter, KVCacheImport, KVHandleError
from store.shard_store import ShardStore
from store.staged_block_sink import ShardPutSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 64, 16, 2, 64
DTYPE = torch.bfloat16
WAIT_S = 120  # bounds every wait on the child; never reached when things work


def seeded_cache(seed: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BS, HEADS, DIM)
    return [
        (
            torch.randn(shape, generator=g).to(DTYPE).to(device),
            torch.randn(shape, generator=g).to(DTYPE).to(device),
        )
        for _ in range(LAYERS)
    ]


def _prefill(export, conn) -> None:
    """The other process, on the same GPU: refused once, then writes and sends its receipt."""
    layout = KVBlockLayout(LAYERS, BS, HEADS, DIM, DTYPE)
    refusals = []
    try:
        KVCacheImport.open(export, replace(layout, block_size=BS * 2), weight_version=1)
    except KVHandleError as e:
        refusals.append(str(e))
    with KVCacheImport.open(export, layout, weight_version=1) as imp:
        src = seeded_cache(7, "cuda")
        imp.write_blocks(src, list(range(8)), [40 + i for i in range(8)])
        done = imp.complete(list(range(40, 48)))
        conn.send((refusals, done, str(imp.device)))


def test_a_second_process_writes_the_decode_cache_through_cuda_ipc():
    shape = (BLOCKS, BS, HEADS, DIM)
    caches = [
        (
            torch.zeros(shape, dtype=DTYPE, device="cuda"),
            torch.zeros(shape, dtype=DTYPE, device="cuda"),
        )
        for _ in range(LAYERS)
    ]
    exporter = KVCacheExporter("decode-0", caches, weight_version=1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(exporter.export(), child), daemon=True)
    proc.start()
    assert parent.poll(WAIT_S), "the prefill process did not answer"
    refusals, done, device = parent.recv()
    proc.join(WAIT_S)
    assert proc.exitcode == 0
    print(f"importer mapped the cache on {device}")
    assert refusals == [
        f"block layout mismatch with 'decode-0': block_size {BS} (exporter) != {2 * BS} (here)"
    ]
    assert exporter.accept(done) == tuple(range(40, 48))
    src = seeded_cache(7, "cuda")
    for (k, v), (sk, sv) in zip(caches, src, strict=True):
        assert torch.equal(k[40:48], sk[:8]) and torch.equal(v[40:48], sv[:8])
        assert not k[:40].any() and not k[48:].any() and not v[:40].any()


def test_gather_and_scatter_move_a_block_between_host_bytes_and_a_cuda_cache():
    caches = seeded_cache(1, "cuda")
    layout = KVBlockLayout.of(caches)
    host = seeded_cache(1, "cpu")
    want = KVBlockLayout.of(host).gather(host, 9)
    assert np.array_equal(layout.gather(caches, 9), want)
    other = seeded_cache(2, "cuda")
    layout.scatter(want, other, 3)
    for kv, ov in zip(caches, other, strict=True):
        assert torch.equal(kv[0][9], ov[0][3]) and torch.equal(kv[1][9], ov[1][3])


def test_a_prefills_layers_reach_the_dram_tier_through_pinned_buffers():
    caches = seeded_cache(3, "cuda")
    layout = KVBlockLayout.of(caches)
    store = ShardStore(layout.block_bytes, 32 * layout.block_bytes)
    blocks = list(range(20, 36))
    hashes = [1000 + b for b in blocks]
    sink = ShardPutSink(store, layout, hashes, blocks)
    with DeviceStaging(sink, layout.piece_bytes, max_blocks=8, device="cuda", depth=2) as st:
        assert all(b.is_pinned() for b in st.buffers)
        for layer, kv in enumerate(caches):
            st.submit(layer, kv, blocks)
        st.flush()
    assert sorted(sink.commit()) == hashes
    for h, b in zip(hashes, blocks, strict=True):
        got = store.get(h)
        assert got is not None and np.array_equal(got, layout.gather(caches, b))
