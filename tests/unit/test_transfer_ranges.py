"""Range transfers of registered local memory (``LocalMemory``, ``read_ranges`` /
``write_ranges``): exact bytes both ways through shm and tcp, merging of contiguous
ranges, every validation error, the generic fallback and the GPU slots. No Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.kvstore.shard import KVStoreClient
from kernels.kv_cache import allocate_kv_cache
from store.kv_block_layout import KVBlockLayout
from store.kv_store_errors import BackendUnavailableError, InvalidBlockError, TransferError
from store.shared_segment import SharedSegment
from store.transfer import Endpoint, LocalMemory, TransferBackend, TransferEngine
from store.transfer.endpoint import CopyOps, normalize_ops, normalize_ranges
from store.transfer.gpu_backends import MooncakeBackend

SEG = 1 << 20
BACKENDS = [((), "shm"), (("tcp",), "tcp")]


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def owner():
    seg = SharedSegment.create(SEG)
    seg.array[:] = payload(SEG, 9)
    engine = TransferEngine("owner", "node-a", seg, serve_tcp=True, serve_nixl=False)
    yield seg, engine
    engine.close()
    seg.close()


@pytest.fixture(params=BACKENDS, ids=[name for _, name in BACKENDS])
def client(request, owner):
    prefer, name = request.param
    engine = TransferEngine("client", "node-a", prefer=prefer)
    assert engine.backend_for(owner[1].endpoint) == name
    yield engine
    engine.close()


def test_read_ranges_copies_exact_bytes(owner, client):
    seg, eng = owner
    pool = np.zeros(64 * 1024, dtype=np.uint8)
    local = client.register(pool)
    ranges = [(4096, 0, 1000), (5096, 1000, 3000), (200_000, 8192, 777), (SEG - 5, 60_000, 5)]
    assert client.read_ranges(eng.endpoint, local, ranges) == 1000 + 3000 + 777 + 5
    want = np.zeros_like(pool)
    for r, lo, n in ranges:
        want[lo : lo + n] = seg.array[r : r + n]
    assert np.array_equal(pool, want)


def test_write_ranges_copies_exact_bytes(owner, client):
    seg, eng = owner
    before = seg.array.copy()
    src = payload(32 * 1024, 1)
    ranges = [(0, 100, 4096), (4096, 4196, 4096), (500_000, 0, 100), (SEG - 64, 20_000, 64)]
    assert client.write_ranges(eng.endpoint, src, ranges) == 4096 + 4096 + 100 + 64
    want = before
    for r, lo, n in ranges:
        want[r : r + n] = src[lo : lo + n]
    assert np.array_equal(seg.array, want)


def test_several_buffers_are_addressed_back_to_back(owner, client):
    seg, eng = owner
    t = torch.zeros(4, 256, dtype=torch.float32)  # 4096 bytes
    b = bytearray(100)
    a = np.zeros(50, dtype=np.uint16)  # 100 bytes
    local = LocalMemory(t, b, a)
    assert local.starts == [0, 4096, 4196] and local.nbytes == 4296
    ranges = [(0, 0, 4096), (10_000, 4096, 100), (20_000, 4196, 100)]
    assert client.read_ranges(eng.endpoint, local, ranges) == 4296
    assert t.view(torch.uint8).numpy().reshape(-1).tobytes() == seg.array[:4096].tobytes()
    assert bytes(b) == seg.array[10_000:10_100].tobytes()
    assert a.view(np.uint8).tobytes() == seg.array[20_000:20_100].tobytes()
    # and back out of them, into other places of the segment
    t.fill_(1.5)
    b[:] = b"x" * 100
    ranges = [(300_000, 0, 4096), (400_000, 4096, 100), (400_100, 4196, 100)]
    assert client.write_ranges(eng.endpoint, local, ranges) == 4296
    assert np.array_equal(seg.array[300_000:304_096], t.view(torch.uint8).numpy().reshape(-1))
    assert seg.array[400_000:400_100].tobytes() == b"x" * 100
    assert seg.array[400_100:400_200].tobytes() == a.view(np.uint8).tobytes()


def test_numpy_range_arrays_and_numpy_ints_are_accepted(owner, client):
    seg, eng = owner
    pool = np.zeros(8192, dtype=np.uint8)
    table = np.array([[0, 0, 4096], [4096, 4096, 4096]], dtype=np.int64)
    assert client.read_ranges(eng.endpoint, pool, table) == 8192
    assert np.array_equal(pool, seg.array[:8192])
    pool[:] = 0
    row = (np.int64(100), np.int32(0), np.uint64(10))
    assert client.read_ranges(eng.endpoint, pool, [row]) == 10
    assert np.array_equal(pool[:10], seg.array[100:110])


def test_kv_cache_blocks_move_as_ranges_like_copy_ops(owner, client):
    """The client's cache ranges put exactly the bytes ``KVBlockLayout`` defines for a
    stored block, and bring them back into another block of another cache."""
    seg, eng = owner
    caches = allocate_kv_cache(3, 5, 2, 2, 8, dtype=torch.bfloat16)
    for k, v in caches:
        k.normal_()
        v.normal_()
    layout = KVBlockLayout.of(caches)
    pieces, num_blocks, piece = KVStoreClient._cache_geometry(caches)
    local = KVStoreClient._register_cache(caches)
    at = 3 * layout.block_bytes
    ranges = KVStoreClient._cache_ranges(pieces, num_blocks, piece, 4, at)
    assert client.write_ranges(eng.endpoint, local, ranges) == layout.block_bytes
    assert np.array_equal(seg.array[at : at + layout.block_bytes], layout.gather(caches, 4))
    other = allocate_kv_cache(3, 5, 2, 2, 8, dtype=torch.bfloat16)
    back = KVStoreClient._cache_ranges(pieces, num_blocks, piece, 1, at)
    client.read_ranges(eng.endpoint, KVStoreClient._register_cache(other), back)
    for (k0, v0), (k1, v1) in zip(caches, other, strict=True):
        assert torch.equal(k0[4], k1[1]) and torch.equal(v0[4], v1[1])
        assert not k1[0].any() and not k1[2:].any()  # nothing else was touched
    for bad in (-1, num_blocks):
        with pytest.raises(InvalidBlockError, match="outside the cache"):
            KVStoreClient._cache_ranges(pieces, num_blocks, piece, bad, 0)
    odd = [caches[0], (caches[1][0], caches[1][1][:4])]
    with pytest.raises(InvalidBlockError, match="one shape and dtype"):
        KVStoreClient._register_cache(odd)


def test_contiguous_ranges_merge_into_one_copy():
    pool = np.zeros(10_000, dtype=np.uint8)
    ranges = [
        (1000, 0, 100),
        (1100, 100, 200),  # continues both: merged
        (1300, 300, 50),  # again
        (5000, 350, 10),  # remote jumps: new copy
        (5010, 400, 10),  # local jumps: new copy
        (5020, 410, 10),  # continues: merged
    ]
    merged = normalize_ranges(LocalMemory(pool), ranges, SEG, writable=True)
    assert [(o, v.size) for o, v in merged] == [(1000, 350), (5000, 10), (5010, 20)]
    merged[0][1][:] = 7  # the merged view is exactly the local bytes of its ranges
    assert (pool[:350] == 7).all() and not pool[350:].any()
    assert merged[2][1].ctypes.data == pool[400:].ctypes.data


def test_ranges_do_not_merge_across_registered_buffers():
    backing = np.zeros(200, dtype=np.uint8)
    local = LocalMemory(backing[:100], backing[100:])  # adjacent in memory, two buffers
    merged = normalize_ranges(local, [(0, 50, 50), (50, 100, 50)], SEG, writable=True)
    assert [(o, v.size) for o, v in merged] == [(0, 50), (50, 50)]
    assert normalize_ranges(local, [], SEG, writable=True) == []


def test_ops_still_merge_and_split_like_before():
    local = np.zeros(4096, dtype=np.uint8)
    ops = [
        (0, local[:1024]),
        (1024, local[1024:2048]),  # continues both: merged
        (2048, local[3072:]),  # remote continues, local does not
        (9000, local[2048:3072]),  # local continues from the first run, remote does not
    ]
    merged = normalize_ops(ops, SEG, writable=True)
    assert [(o, v.size) for o, v in merged] == [(0, 2048), (2048, 1024), (9000, 1024)]
    assert merged[1][1].ctypes.data == local[3072:].ctypes.data


def test_range_validation_errors_are_clear():
    pool = np.zeros(1000, dtype=np.uint8)
    local = LocalMemory(pool, np.zeros(100, dtype=np.uint8))

    def check(ranges, writable=True, segment_bytes=SEG, local=local):
        return normalize_ranges(local, ranges, segment_bytes, writable)

    with pytest.raises(TransferError, match="outside the remote segment"):
        check([(SEG - 10, 0, 11)])
    with pytest.raises(TransferError, match="outside the remote segment"):
        check([(-1, 0, 10)])
    with pytest.raises(InvalidBlockError, match="outside one registered local buffer"):
        check([(0, 990, 20)])  # crosses from the first buffer into the second
    with pytest.raises(InvalidBlockError, match="outside one registered local buffer"):
        check([(0, 1090, 20)])  # past the end
    with pytest.raises(InvalidBlockError, match="outside one registered local buffer"):
        check([(0, -5, 5)])
    with pytest.raises(InvalidBlockError, match="outside the local memory"):
        check([(0, 999, 2)], local=LocalMemory(pool))
    with pytest.raises(InvalidBlockError, match="outside"):
        check([(0, 0, 1)], local=LocalMemory())
    for n in (0, -3):
        with pytest.raises(InvalidBlockError, match="nbytes must be positive"):
            check([(0, 0, n)])
    for bad in ((0, 0), (0, 0, 1, 2), 7, None):
        with pytest.raises(InvalidBlockError, match=r"\(remote offset, local offset, nbytes\)"):
            check([bad])
    for bad, what in (
        (("0", 0, 1), "remote offset"),
        ((0, 1.0, 1), "local offset"),
        ((0, 0, True), "nbytes"),
        ((False, 0, 1), "remote offset"),
    ):
        with pytest.raises(InvalidBlockError, match=f"{what} must be an int"):
            check([bad])
    read_only = LocalMemory(b"read-only bytes")
    with pytest.raises(InvalidBlockError, match="writable"):
        check([(0, 0, 4)], local=read_only)
    assert check([(0, 0, 4)], writable=False, local=read_only)[0][1].tobytes() == b"read"


def test_registration_refuses_what_it_cannot_view():
    with pytest.raises(InvalidBlockError, match="contiguous"):
        LocalMemory(np.zeros((4, 4), dtype=np.uint8)[:, 1])
    with pytest.raises(InvalidBlockError, match="contiguous"):
        LocalMemory(torch.zeros(4, 4).t())
    with pytest.raises(InvalidBlockError, match="empty"):
        LocalMemory(b"")
    with pytest.raises(InvalidBlockError, match="bytes-like"):
        LocalMemory(object())
    with pytest.raises(InvalidBlockError, match="contiguous"):  # raw buffers are registered
        normalize_ranges(np.zeros(10, np.uint8)[::2], [(0, 0, 1)], SEG, True)


def test_engine_refuses_bad_ranges_through_both_backends(owner, client):
    seg, eng = owner
    before = seg.array.copy()
    pool = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(TransferError, match="outside"):
        client.read_ranges(eng.endpoint, pool, [(SEG - 10, 0, 11)])
    with pytest.raises(InvalidBlockError, match="writable"):
        client.read_ranges(eng.endpoint, b"read-only bytes", [(0, 0, 4)])
    with pytest.raises(InvalidBlockError, match="outside"):
        client.write_ranges(eng.endpoint, pool, [(0, 0, 10), (10, 4090, 10)])
    with pytest.raises(InvalidBlockError):
        client.write_ranges(eng.endpoint, pool, [("zero", 0, 1)])
    assert np.array_equal(seg.array, before)  # a refused transfer moved nothing
    assert client.write_ranges(eng.endpoint, pool, [(0, 0, 16)]) == 16  # still usable


class _ArrayBackend(TransferBackend):
    """A backend with only ``read``/``write`` (over a plain array): ranges reach it as
    one op per merged range."""

    name = "array"

    def __init__(self, remote: np.ndarray) -> None:
        self.remote = remote
        self.calls: list[list[tuple[int, int]]] = []

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        norm = normalize_ops(ops, remote.segment_bytes, writable=True)
        self.calls.append([(o, v.size) for o, v in norm])
        for o, v in norm:
            v[:] = self.remote[o : o + v.size]
        return sum(v.size for _, v in norm)

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        norm = normalize_ops(ops, remote.segment_bytes, writable=False)
        self.calls.append([(o, v.size) for o, v in norm])
        for o, v in norm:
            self.remote[o : o + v.size] = v
        return sum(v.size for _, v in norm)


def test_backends_without_ranges_get_them_as_ops():
    remote = payload(4096, 4)
    backend = _ArrayBackend(remote)
    ep = Endpoint("r", "n", segment_bytes=remote.size)
    pool = np.zeros(300, dtype=np.uint8)
    assert backend.read_ranges(ep, LocalMemory(pool), [(10, 0, 100), (110, 100, 100)]) == 200
    assert backend.calls == [[(10, 200)]]
    assert np.array_equal(pool[:200], remote[10:210])
    backend.write_ranges(ep, LocalMemory(payload(50, 5)), [(3000, 0, 50)])
    assert np.array_equal(remote[3000:3050], payload(50, 5))
    with pytest.raises(TransferError, match="outside"):
        backend.read_ranges(ep, LocalMemory(pool), [(4000, 0, 100)])


def test_gpu_slots_refuse_ranges_with_their_clear_error():
    cls = MooncakeBackend  # NCCL is wired: tests/unit/test_transfer_collective.py
    with pytest.raises(BackendUnavailableError, match=cls.name):
        TransferEngine("c", "n", prefer=[cls.name])
    slot = object.__new__(cls)  # never built for real: construction refuses
    ep = Endpoint("r", "n", segment_bytes=10)
    with pytest.raises(BackendUnavailableError, match="slot"):
        slot.read_ranges(ep, LocalMemory(np.zeros(4, np.uint8)), [(0, 0, 4)])
    with pytest.raises(BackendUnavailableError, match="slot"):
        slot.write_ranges(ep, LocalMemory(np.zeros(4, np.uint8)), [(0, 0, 4)])


def test_ranges_and_ops_agree_on_random_transfers(owner):
    """Random block-sized moves: the range path and the ops path land the same bytes."""
    seg, eng = owner
    client = TransferEngine("client", "node-a")
    rng = np.random.default_rng(11)
    block = 4096
    for _ in range(5):
        k = int(rng.integers(1, 40))
        remote_blocks = rng.choice(SEG // block, size=k, replace=False)
        local_blocks = rng.choice(64, size=k, replace=False)
        if rng.random() < 0.5:  # sometimes long contiguous runs, to exercise merging
            remote_blocks.sort()
            local_blocks = np.arange(k) + int(rng.integers(0, 64 - k + 1))
        a = np.zeros(64 * block, dtype=np.uint8)
        b = np.zeros(64 * block, dtype=np.uint8)
        ranges = [
            (int(r) * block, int(lo) * block, block)
            for r, lo in zip(remote_blocks, local_blocks, strict=True)
        ]
        ops = [(r, b[lo : lo + n]) for r, lo, n in ranges]
        assert client.read_ranges(eng.endpoint, a, ranges) == client.read(eng.endpoint, ops)
        assert np.array_equal(a, b)
    client.close()
