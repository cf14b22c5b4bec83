"""The pinned-buffer pipeline (``store.device_staging``) and its sinks
(``store.staged_block_sink``), with the device as a parameter: the CPU always, CUDA when
this machine has it (skipped otherwise). Bytes at the consumer equal the cache's blocks for
every layer, buffers are reused in ring order, a slow consumer holds the producer back
instead of being overwritten, and a consumer's error surfaces without a hang."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch

from store.device_staging import DeviceStaging, StagedLayer, StagingError
from store.kv_block_layout import KVBlockLayout
from store.kv_store_errors import InvalidBlockError, WriteStateError
from store.shard_store import ShardStore
from store.shared_segment import SharedSegment
from store.staged_block_sink import RangesSink, ShardPutSink
from store.transfer import TransferEngine

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 8, 4, 2, 8
WAIT_S = 10  # bounds every wait; never reached when things work

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def caches_on(device: str, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = (BLOCKS, BS, HEADS, DIM)
    return [
        tuple(torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
        for _ in range(LAYERS)
    ]


def piece(t: torch.Tensor, b: int) -> np.ndarray:
    return t[b].cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


class Recorder:
    """A consumer that copies what it is given (the views die with the call)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, tuple[int, ...], int, np.ndarray, np.ndarray, int]] = []

    def __call__(self, s: StagedLayer) -> None:
        self.items.append((s.layer, s.block_ids, s.start, s.k.copy(), s.v.copy(), s.buffer))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layers_blocks_arrive_in_order_and_buffers_go_round_the_ring(device, dtype):
    caches = caches_on(device, dtype)
    layout = KVBlockLayout.of(caches)
    rec = Recorder()
    blocks = [6, 1, 3, 0, 7]  # 5 blocks, 2 per buffer: each layer arrives in 3 parts
    with DeviceStaging(rec, layout.piece_bytes, max_blocks=2, device=device, depth=3) as st:
        for layer, kv in enumerate(caches):
            st.submit(layer, kv, blocks)
        assert st.flush() == 3 * LAYERS
    assert [(layer, start) for layer, _, start, *_ in rec.items] == [
        (layer, s) for layer in range(LAYERS) for s in (0, 2, 4)
    ]
    assert [it[5] for it in rec.items] == [i % 3 for i in range(3 * LAYERS)]  # ring order
    for layer, ids, start, k, v, _ in rec.items:
        assert list(ids) == blocks[start : start + 2]
        for i, b in enumerate(ids):
            assert np.array_equal(k[i], piece(caches[layer][0], b))
            assert np.array_equal(v[i], piece(caches[layer][1], b))


def test_a_slow_consumer_holds_the_producer_back_and_its_bytes_are_not_overwritten():
    caches = caches_on("cpu")
    layout = KVBlockLayout.of(caches)
    release = threading.Event()
    entered = threading.Event()
    seen: list[bool] = []

    def slow(s: StagedLayer) -> None:
        if s.layer == 0:
            entered.set()
            assert release.wait(WAIT_S)
        # still this layer's bytes, however long the consumer took
        seen.append(np.array_equal(s.k[0], piece(caches[s.layer][0], 2)))

    st = DeviceStaging(slow, layout.piece_bytes, max_blocks=1, device="cpu", depth=2)
    st.submit(0, caches[0], [2])
    st.submit(1, caches[1], [2])  # the second buffer: no wait
    assert entered.wait(WAIT_S)
    third = threading.Thread(target=st.submit, args=(2, caches[2], [2]))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # layer 0 still holds buffer 0: the producer waits
    release.set()
    third.join(WAIT_S)
    assert not third.is_alive()
    assert st.flush() == 3 and seen == [True, True, True]
    st.close()


def test_a_consumer_error_surfaces_and_nothing_hangs():
    caches = caches_on("cpu")
    layout = KVBlockLayout.of(caches)
    calls: list[int] = []

    def failing(s: StagedLayer) -> None:
        calls.append(s.layer)
        if s.layer == 1:
            raise OSError("disk full")

    st = DeviceStaging(failing, layout.piece_bytes, max_blocks=4, device="cpu", depth=2)
    with pytest.raises(StagingError, match="layer 1: OSError: disk full") as err:
        for layer, kv in enumerate(caches):
            st.submit(layer, kv, [0, 1])
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(StagingError):
        st.flush()
    st.close()
    assert calls == [0, 1]  # nothing is delivered after the failure


def test_bad_submissions_are_refused():
    caches = caches_on("cpu")
    layout = KVBlockLayout.of(caches)
    with DeviceStaging(Recorder(), layout.piece_bytes, 2, "cpu") as st:
        with pytest.raises(InvalidBlockError, match="outside the cache"):
            st.submit(0, caches[0], [BLOCKS])
    with DeviceStaging(Recorder(), layout.piece_bytes + 1, 2, "cpu") as st:
        with pytest.raises(InvalidBlockError, match="pieces"):
            st.submit(0, caches[0], [0])


@pytest.mark.parametrize("device", DEVICES)
def test_the_dram_tier_gets_whole_blocks_committed_only_after_the_last_layer(device):
    caches = caches_on(device)
    layout = KVBlockLayout.of(caches)
    store = ShardStore(layout.block_bytes, 16 * layout.block_bytes)
    hashes, blocks = [11, 12, 13], [5, 2, 7]
    assert store.put(12, layout.gather(caches, 2))  # already stored: skipped by the sink
    sink = ShardPutSink(store, layout, hashes, blocks)
    with DeviceStaging(sink, layout.piece_bytes, max_blocks=2, device=device) as st:
        for layer, kv in enumerate(caches):
            assert not store.contains(11)  # invisible until commit
            st.submit(layer, kv, blocks)
        st.flush()
    assert sorted(sink.commit()) == [11, 13]
    for h, b in zip(hashes, blocks, strict=True):
        got = store.get(h)
        assert got is not None and np.array_equal(got, layout.gather(caches, b))

    partial = ShardPutSink(store, layout, [21], [4])
    with DeviceStaging(partial, layout.piece_bytes, 2, device) as st:
        st.submit(0, caches[0], [4])  # one layer of four
        st.flush()
    with pytest.raises(WriteStateError, match="miss layers"):
        partial.commit()
    assert not store.contains(21) and store.begin_put(21, 8) is not None  # slot freed


def test_a_remote_shards_reserved_ranges_get_each_layer_through_the_transfer_layer():
    caches = caches_on("cpu", torch.bfloat16)
    layout = KVBlockLayout.of(caches)
    seg = SharedSegment.create(4 * layout.block_bytes)
    owner = TransferEngine("shard", "node-a", seg, serve_tcp=False)
    writer = TransferEngine("writer", "node-a")
    try:
        offsets = {3: 2 * layout.block_bytes, 6: 0}  # block 1 is not sent
        sink = RangesSink(functools.partial(writer.write_ranges, owner.endpoint), layout, offsets)
        with DeviceStaging(sink, layout.piece_bytes, max_blocks=2, device="cpu") as st:
            for layer, kv in enumerate(caches):
                st.submit(layer, kv, [3, 1, 6])
            st.flush()
        assert sink.bytes_sent == 2 * layout.block_bytes
        for b, off in offsets.items():
            got = seg.array[off : off + layout.block_bytes]
            assert np.array_equal(got, layout.gather(caches, b))
        assert not seg.array[layout.block_bytes : 2 * layout.block_bytes].any()
    finally:
        writer.close()
        owner.close()
        seg.close()


def test_a_device_is_named_with_its_index_as_its_tensors_report_it():
    from store.devices import with_index

    assert with_index("cpu") == torch.device("cpu")
    assert with_index("cuda:1") == torch.device("cuda", 1)  # an index given: no CUDA call
    assert with_index(torch.device("cuda", 2)).index == 2
