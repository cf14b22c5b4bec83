"""The KV-cache handle exchange (``store.kv_cache_ipc``) on the CPU: a decode side exports
its shared-memory cache, a spawned prefill process opens it (after a wrong layout and a
wrong weight version are refused with what differs), writes blocks into it and sends its
receipt; every byte is checked here. The same protocol runs CUDA IPC handles on a GPU
(``tests/gpu/test_kv_cache_ipc_cuda.py``)."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import numpy as np
import pytest
import torch

from store.kv_block_layout import KVBlockLayout
from store.kv_cache_ipc import (
    KVCacheExporter,
    KVCacheImport,
    KVHandleError,
    KVWriteDone,
    TensorHandle,
)
from store.shared_segment import SharedSegment

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 4, 2, 8
DTYPE = torch.bfloat16
WAIT_S = 60  # bounds every wait on the child; never reached when things work


def cache_in(seg: SharedSegment) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A decode worker's cache as ``SharedKVCache`` lays it out: K then V per layer."""
    flat = torch.frombuffer(seg.array, dtype=DTYPE)
    shape, per = (BLOCKS, BS, HEADS, DIM), BLOCKS * BS * HEADS * DIM
    return [
        (
            flat[2 * i * per : (2 * i + 1) * per].view(shape),
            flat[(2 * i + 1) * per : (2 * i + 2) * per].view(shape),
        )
        for i in range(LAYERS)
    ]


def prefill_cache() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    shape = (BLOCKS, BS, HEADS, DIM)
    return [
        (torch.randn(shape, generator=g).to(DTYPE), torch.randn(shape, generator=g).to(DTYPE))
        for _ in range(LAYERS)
    ]


def host_block() -> np.ndarray:
    return np.arange(
        KVBlockLayout(LAYERS, BS, HEADS, DIM, DTYPE).block_bytes, dtype=np.uint32
    ).astype(np.uint8)


def _prefill(export, conn) -> None:
    """The other process: refused twice, then writes and sends its receipt."""
    layout = KVBlockLayout(LAYERS, BS, HEADS, DIM, DTYPE)
    refusals = []
    for lay, wv in ((replace(layout, head_dim=DIM * 2), 3), (layout, 4)):
        try:
            KVCacheImport.open(export, lay, weight_version=wv)
        except KVHandleError as e:
            refusals.append(str(e))
    with KVCacheImport.open(export, layout, weight_version=3, device="cpu") as imp:
        imp.write_blocks(prefill_cache(), [1, 3], [4, 0])
        imp.scatter(host_block(), 2)
        conn.send((refusals, imp.complete([4, 0, 2])))


def test_a_spawned_importer_writes_the_exporters_cache_byte_for_byte():
    layout = KVBlockLayout(LAYERS, BS, HEADS, DIM, DTYPE)
    seg = SharedSegment.create(2 * LAYERS * BLOCKS * layout.piece_bytes)
    try:
        caches = cache_in(seg)
        exporter = KVCacheExporter("decode-0", caches, weight_version=3, segment=seg)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_prefill, args=(exporter.export(), child), daemon=True)
        proc.start()
        assert parent.poll(WAIT_S), "the prefill process did not answer"
        refusals, done = parent.recv()
        proc.join(WAIT_S)
        assert proc.exitcode == 0
        assert refusals == [
            "block layout mismatch with 'decode-0': head_dim 8 (exporter) != 16 (here)",
            "'decode-0''s cache holds KV of weight version 3, this side computes version 4: "
            "open its export after both updated",
        ]
        assert exporter.accept(done) == (4, 0, 2)
        assert done.nbytes == 3 * layout.block_bytes
        src = prefill_cache()
        for (k, v), (sk, sv) in zip(caches, src, strict=True):
            assert torch.equal(k[4], sk[1]) and torch.equal(v[4], sv[1])
            assert torch.equal(k[0], sk[3]) and torch.equal(v[0], sv[3])
            assert not k[1].any() and not k[3].any() and not k[5].any()  # nothing else
        assert np.array_equal(layout.gather(caches, 2), host_block())
        exporter.revoke()  # a receipt of the old generation is refused from now on
        with pytest.raises(KVHandleError, match="generation 0 .* at 1"):
            exporter.accept(done)
    finally:
        seg.close()


def test_exports_and_receipts_that_do_not_fit_are_refused_in_process():
    layout = KVBlockLayout(LAYERS, BS, HEADS, DIM, DTYPE)
    with SharedSegment.create(2 * LAYERS * BLOCKS * layout.piece_bytes) as seg:
        caches = cache_in(seg)
        with pytest.raises(KVHandleError, match="pass segment="):
            KVCacheExporter("d", caches).export()
        with pytest.raises(KVHandleError, match="outside shared-memory segment"):
            KVCacheExporter(
                "d", [(torch.zeros(BLOCKS, BS, HEADS, DIM, dtype=DTYPE),) * 2] * LAYERS, segment=seg
            ).export()
        exporter = KVCacheExporter("d", caches, segment=seg, node="node-a")
        export = exporter.export()
        assert exporter.export() is export  # one export per generation
        with pytest.raises(KVHandleError, match="on node 'node-a', this side runs on 'node-b'"):
            KVCacheImport.open(export, layout, node="node-b")
        with pytest.raises(KVHandleError, match="format v9"):
            KVCacheImport.open(replace(export, version=9), layout, node="node-a")
        with pytest.raises(KVHandleError, match="in host shared memory"):
            KVCacheImport.open(export, layout, device="cuda", node="node-a")
        gpu = replace(
            export,
            device="cuda",
            place="GPU-0000",
            handles=((TensorHandle("cuda_ipc", ()),) * 2,) * LAYERS,
        )
        if not torch.cuda.is_available():
            with pytest.raises(KVHandleError, match="GPU-0000; CUDA is not available"):
                KVCacheImport.open(gpu, layout)
        with KVCacheImport.open(export, layout, node="node-a") as imp:  # same process: fine
            with pytest.raises(KVHandleError, match=r"blocks \[6\] are outside"):
                imp.write_layer(0, caches[0], [0], [BLOCKS])
            done = imp.complete([])
        with pytest.raises(KVHandleError, match="was dropped"):
            imp.scatter(host_block(), 0)
        with pytest.raises(KVHandleError, match="weight version"):
            exporter.accept(replace(done, weight_version=2))
        with pytest.raises(KVHandleError, match="reached 'd'"):
            exporter.accept(KVWriteDone("e", 0, None, (), 0))
