"""The collective transfer backend (``store/transfer/collective_backend.py``) between two real
processes, through gloo: the same code NCCL runs on CUDA tensors. The owner of a shared
segment serves it from a spawned process; this process reads and writes it and checks every
byte through its own mapping. No Ray."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from store.kv_store_errors import BackendUnavailableError, TransferError
from store.shared_segment import SharedSegment
from store.transfer import Endpoint, LocalMemory, TransferEngine, backend_names
from store.transfer.collective_backend import GlooBackend, NcclBackend

SEG = 1 << 20
WAIT_S = 60  # bounds every wait on the child; never reached when things work


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _owner(name: str, conn) -> None:
    """Another process: serve the segment ``name`` through gloo until told to stop. Told
    "die", it exits in the middle of its next copy instead (after accepting the call)."""
    seg = SharedSegment.attach(name, SEG)
    engine = TransferEngine("owner", "node-b", seg, serve_collective="gloo")
    conn.send(engine.endpoint)
    if conn.recv() == "die":
        from store.transfer import collective_backend

        def die(*_: object) -> None:
            os._exit(1)

        collective_backend._move = die  # type: ignore[assignment]  # the owner's half of a copy
        conn.send("armed")
        conn.recv()
    engine.close()
    seg.close()


def _start_owner(seg: SharedSegment):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(seg.name, child), daemon=True)
    proc.start()
    assert parent.poll(WAIT_S), "the owner process did not start"
    return proc, parent, parent.recv()


def _stop(proc, conn) -> None:
    if proc.is_alive():
        conn.send("stop")
        proc.join(WAIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


@pytest.fixture(scope="module")
def owner():
    """(the segment as mapped here, the owner's endpoint, a caller engine preferring gloo)."""
    seg = SharedSegment.create(SEG)
    proc, conn, endpoint = _start_owner(seg)
    caller = TransferEngine("caller", "node-a", prefer=("gloo",))
    try:
        yield seg, endpoint, caller
    finally:
        caller.close()
        _stop(proc, conn)
        seg.close()


def test_ops_move_exact_bytes_both_ways(owner):
    seg, ep, caller = owner
    assert caller.backend_for(ep) == "gloo"
    a, b = payload(3000, 1), payload(700, 2)
    read_only = np.frombuffer(payload(50, 3).tobytes(), dtype=np.uint8)
    # a[:1000] and a[1000:] continue each other on both sides: one copy
    moved = caller.write(ep, [(100, a[:1000]), (1100, a[1000:]), (70_000, b), (9, read_only)])
    assert moved == 3750
    assert np.array_equal(seg.array[100:3100], a)
    assert np.array_equal(seg.array[70_000:70_700], b)
    assert np.array_equal(seg.array[9:59], read_only)

    seg.array[SEG - 4096 :] = payload(4096, 4)
    seg.array[200_000:200_333] = payload(333, 5)
    tail, mid = np.zeros(4096, np.uint8), np.zeros(333, np.uint8)
    assert caller.read(ep, [(SEG - 4096, tail), (200_000, mid)]) == 4429
    assert np.array_equal(tail, payload(4096, 4))
    assert np.array_equal(mid, payload(333, 5))


def test_ranges_move_exact_bytes_merged_and_not(owner):
    seg, ep, caller = owner
    k, v = payload(8192, 6), payload(4096, 7)
    local = LocalMemory(k, v)  # local bytes [0, 8192) are k, [8192, 12288) are v
    # (remote offset, local offset, nbytes): the first two continue each other (one copy),
    # the third starts a new local run, the fourth lies in the second buffer
    ranges = [(300_000, 0, 1024), (301_024, 1024, 1024), (310_000, 4096, 512), (5, 8192, 4096)]
    assert caller.write_ranges(ep, local, ranges) == 6656
    for r, lo, n in ranges:
        assert np.array_equal(seg.array[r : r + n], np.concatenate([k, v])[lo : lo + n])

    seg.array[400_000:402_000] = payload(2000, 8)
    back_k, back_v = np.zeros(8192, np.uint8), np.zeros(4096, np.uint8)
    back = LocalMemory(back_k, back_v)
    ranges = [(400_000, 10, 1000), (401_000, 1010, 1000), (400_500, 8192 + 7, 64)]
    assert caller.read_ranges(ep, back, ranges) == 2064
    assert np.array_equal(back_k[10:2010], payload(2000, 8))
    assert np.array_equal(back_v[7:71], payload(2000, 8)[500:564])
    assert not back_k[:10].any() and not back_k[2010:].any()  # nothing else was written


def test_out_of_range_ops_are_refused_and_the_connection_survives(owner):
    seg, ep, caller = owner
    buf = np.zeros(100, np.uint8)
    with pytest.raises(TransferError, match="outside the remote segment"):
        caller.read(ep, [(SEG - 50, buf)])
    with pytest.raises(TransferError, match="outside the remote segment"):
        caller.write_ranges(ep, LocalMemory(buf), [(SEG, 0, 1)])
    # an endpoint claiming a larger segment passes the caller's check: the owner refuses
    liar = replace(ep, segment_bytes=2 * SEG)
    with pytest.raises(TransferError, match="remote refused.*outside the segment"):
        caller.read(liar, [(SEG + 10, buf)])
    seg.array[:100] = payload(100, 9)
    assert caller.read(ep, [(0, buf)]) == 100  # nothing was posted: the pair still works
    assert np.array_equal(buf, payload(100, 9))


def test_an_owner_that_dies_mid_copy_gives_a_transfer_error_not_a_hang():
    seg = SharedSegment.create(SEG)
    proc, conn, ep = _start_owner(seg)
    caller = GlooBackend(timeout_s=20)  # gloo sees the closed pair at once; this bounds it
    try:
        seg.array[:64] = payload(64, 10)
        out = np.zeros(64, np.uint8)
        assert caller.read(ep, [(0, out)]) == 64  # the pair is up
        conn.send("die")
        assert conn.poll(WAIT_S) and conn.recv() == "armed"
        with pytest.raises(TransferError, match="gloo transfer with 'owner' failed"):
            caller.read(ep, [(0, out)])
        proc.join(WAIT_S)
        assert proc.exitcode == 1
        with pytest.raises(TransferError, match="'owner'"):  # gone: no connection at all
            caller.write(ep, [(0, out)])
    finally:
        caller.close()
        _stop(proc, conn)
        seg.close()


def test_registered_by_name_and_clear_without_an_address_or_a_gpu():
    assert {"gloo", "nccl"} <= set(backend_names())
    caller = TransferEngine("c", "n", prefer=("gloo",))
    no_address = Endpoint("far", "n2", segment_bytes=10)
    with pytest.raises(BackendUnavailableError, match="serve_collective='gloo'"):
        caller.read(no_address, [(0, np.zeros(1, np.uint8))])
    caller.close()
    if torch.cuda.is_available():
        pytest.skip("the refusals below are for hosts without a GPU")
    assert not NcclBackend.available()
    with pytest.raises(BackendUnavailableError, match="'nccl' needs a CUDA build"):
        NcclBackend()
    seg = SharedSegment.create(4096)
    try:
        with pytest.raises(BackendUnavailableError, match="'nccl' needs a CUDA build"):
            TransferEngine("o", "n", seg, serve_collective="nccl")
    finally:
        seg.close()
