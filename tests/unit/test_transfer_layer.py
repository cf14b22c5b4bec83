"""The KV transfer layer between real processes: shared memory on one node, TCP across
(loopback here), backend choice, range checks, and the GPU slots' errors. No Ray."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels.kv_cache import allocate_kv_cache
from store.kv_block_layout import KVBlockLayout
from store.kv_store_errors import BackendUnavailableError, InvalidBlockError, TransferError
from store.shared_segment import PREFIX, SharedSegment, remove_stale_segments
from store.transfer import Endpoint, TransferEngine, backend_names
from store.transfer.endpoint import normalize_ops
from store.transfer.nixl_backend import nixl_api

SEG = 1 << 20


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _peer(endpoint: Endpoint, node_id: str, backend: str, conn) -> None:
    """Another process: write a pattern into the remote segment, read another back."""
    engine = TransferEngine("peer", node_id)
    try:
        chosen = engine.backend_for(endpoint)
        engine.write(endpoint, [(4096, payload(8192, 1)), (65536, payload(100, 2))])
        out = np.empty(5000, dtype=np.uint8)
        engine.read(endpoint, [(200_000, out)])
        conn.send((chosen, out.tobytes()))
    except Exception as e:  # report to the parent instead of dying silently
        conn.send(("error", repr(e)))
    finally:
        engine.close()


@pytest.mark.parametrize("peer_node,expected", [("node-a", "shm"), ("node-b", "tcp")])
def test_bytes_cross_processes_identical(peer_node, expected):
    seg = SharedSegment.create(SEG)
    engine = TransferEngine("owner", "node-a", seg, serve_tcp=True, serve_nixl=False)
    seg.array[200_000:205_000] = payload(5000, 3)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(engine.endpoint, peer_node, expected, child))
    p.start()
    chosen, got = parent.recv()
    p.join(timeout=60)
    try:
        assert chosen == expected, got
        assert got == payload(5000, 3).tobytes()
        assert np.array_equal(seg.array[4096 : 4096 + 8192], payload(8192, 1))
        assert np.array_equal(seg.array[65536 : 65536 + 100], payload(100, 2))
    finally:
        engine.close()
        seg.close()


def test_segment_is_a_real_shared_file_and_goes_away():
    seg = SharedSegment.create(SEG)
    other = SharedSegment.attach(seg.name, SEG)
    other.array[:4] = [1, 2, 3, 4]
    assert list(seg.array[:4]) == [1, 2, 3, 4]
    assert seg.path.exists()
    other.close()
    seg.close()
    assert not seg.path.exists()
    with pytest.raises(TransferError, match="gone"):
        SharedSegment.attach(seg.name, SEG)
    assert seg.name not in remove_stale_segments()


def test_released_pages_go_back_to_the_node_and_the_mapping_stays():
    """A sleeping decode worker's cache: its memory is freed in every process that maps
    it, the name and mappings stay, and the pages read as zeros once touched again."""
    seg = SharedSegment.create(SEG)
    other = SharedSegment.attach(seg.name, SEG)
    try:
        seg.array[:] = payload(SEG, 4)
        assert os.stat(seg.path).st_blocks * 512 >= SEG
        assert seg.release_pages() >= SEG
        assert os.stat(seg.path).st_blocks == 0
        assert not other.array.any()
        with pytest.raises(TransferError, match="owner"):
            other.release_pages()
        seg.prefault()
        assert os.stat(seg.path).st_blocks * 512 >= SEG
        other.array[:4] = [5, 6, 7, 8]
        assert list(seg.array[:4]) == [5, 6, 7, 8]
    finally:
        other.close()
        seg.close()


def test_a_killed_owners_segment_is_removed_by_the_next_create(tmp_path):
    code = (
        "import os, signal, sys; from store.shared_segment import SharedSegment; "
        f"s = SharedSegment.create({SEG}, shm_dir={str(tmp_path)!r}); print(s.name, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    killed = out.stdout.strip()
    assert killed and (tmp_path / killed).exists()  # SIGKILL: the owner never unlinked it
    # a dead pid whose lock is still held (a live owner in another pid namespace) stays
    held = tmp_path / f"{PREFIX}999999999-00"
    held.write_bytes(b"0" * SEG)
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        seg = SharedSegment.create(SEG, shm_dir=str(tmp_path))
        assert not (tmp_path / killed).exists()
        assert held.exists() and seg.path.exists()
        seg.close()
    finally:
        os.close(fd)
    assert remove_stale_segments(str(tmp_path)) == [held.name]


def test_kv_cache_blocks_move_in_one_copy_through_the_layer():
    layout_caches = allocate_kv_cache(3, 4, 2, 2, 8, dtype=torch.bfloat16)
    layout = KVBlockLayout.of(layout_caches)
    for k, v in layout_caches:
        k.normal_()
        v.normal_()
    seg = SharedSegment.create(4 * layout.block_bytes)
    owner = TransferEngine("shard", "n", seg)
    worker = TransferEngine("worker", "n")
    worker.write(owner.endpoint, layout.copy_ops(layout_caches, 2, layout.block_bytes))
    stored = seg.array[layout.block_bytes : 2 * layout.block_bytes]
    assert np.array_equal(stored, layout.gather(layout_caches, 2))
    other = allocate_kv_cache(3, 4, 2, 2, 8, dtype=torch.bfloat16)
    worker.read(owner.endpoint, layout.copy_ops(other, 0, layout.block_bytes))
    for (k0, v0), (k1, v1) in zip(layout_caches, other, strict=True):
        assert torch.equal(k0[2], k1[0]) and torch.equal(v0[2], v1[0])
    layout.scatter(stored, other, 3)
    assert torch.equal(other[1][1][3], layout_caches[1][1][2])
    worker.close()
    owner.close()
    seg.close()


def test_adjacent_ops_merge_into_one_copy():
    local = np.zeros(4096, dtype=np.uint8)
    ops = [(1000, local[:1024]), (2024, local[1024:2048]), (5000, local[2048:3072])]
    merged = normalize_ops(ops, SEG, writable=True)
    assert [(o, v.size) for o, v in merged] == [(1000, 2048), (5000, 1024)]
    merged[0][1][:] = 7  # the merged view is exactly the two local slices
    assert (local[:2048] == 7).all() and (local[2048:] == 0).all()


def test_out_of_range_and_bad_ops_are_refused():
    seg = SharedSegment.create(SEG)
    owner = TransferEngine("o", "n", seg, serve_tcp=True, serve_nixl=False)
    for prefer in ((), ("tcp",)):
        eng = TransferEngine("c", "n", prefer=prefer)
        with pytest.raises(TransferError, match="outside"):
            eng.read(owner.endpoint, [(SEG - 10, np.zeros(11, np.uint8))])
        with pytest.raises(InvalidBlockError):
            eng.read(owner.endpoint, [(0, b"read-only bytes")])
        with pytest.raises(InvalidBlockError):
            eng.write(owner.endpoint, [("zero", b"x")])
        eng.close()
    bad_token = Endpoint(**{**owner.endpoint.__dict__, "token": "x" * 32, "endpoint_id": "z"})
    eng = TransferEngine("c", "other-node")
    with pytest.raises(TransferError, match="token"):
        eng.read(bad_token, [(0, np.zeros(4, np.uint8))])
    eng.close()
    owner.close()
    seg.close()


def test_no_route_and_missing_gpu_packages_give_clear_errors():
    eng = TransferEngine("c", "n1")
    far = Endpoint("far", "n2", segment_name="meridian-kv-1-00", segment_bytes=10)
    with pytest.raises(BackendUnavailableError, match="no transfer backend"):
        eng.read(far, [(0, np.zeros(1, np.uint8))])
    assert {"shm", "tcp", "nccl", "mooncake", "nixl"} <= set(backend_names())
    missing = ["nccl", "mooncake"] + ([] if nixl_api() else ["nixl"])  # NIXL: optional
    for name in missing:
        with pytest.raises(BackendUnavailableError, match=name):
            TransferEngine("c", "n", prefer=[name])
    with pytest.raises(BackendUnavailableError, match="unknown transfer backend"):
        TransferEngine("c", "n", prefer=["carrier-pigeon"])
    eng.close()
