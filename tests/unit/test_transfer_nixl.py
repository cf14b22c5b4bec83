"""The NIXL backend between two real processes through its UCX backend, on CPU: a segment
owner serves NIXL, a peer on "another node" reads and writes byte ranges of it (merged
runs, registered memory). Skipped where no NIXL package is installed (it is not a project
dependency; on CPU: pip install --no-deps nixl-cu12 numpy)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from store.shared_segment import SharedSegment
from store.transfer import Endpoint, TransferEngine
from store.transfer.nixl_backend import nixl_api

pytestmark = pytest.mark.skipif(nixl_api() is None, reason="no NIXL package installed")


def payload(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _peer(endpoint: Endpoint, conn) -> None:
    engine = TransferEngine("peer", "node-b")  # another node: no shared memory with it
    try:
        chosen = engine.backend_for(endpoint)
        pool = np.zeros(1 << 16, dtype=np.uint8)
        local = engine.register(pool)
        pool[:8192] = payload(8192, 1)
        # two ranges that merge into one copy, and one apart
        wrote = engine.write_ranges(
            endpoint, local, [(4096, 0, 4096), (8192, 4096, 4096), (60_000, 100, 50)]
        )
        got = engine.read_ranges(endpoint, local, [(200_000, 20_000, 5000)])
        conn.send((chosen, wrote, got, pool[20_000:25_000].tobytes()))
    except Exception as e:
        conn.send(("error", repr(e), 0, b""))
    finally:
        engine.close()


def test_nixl_moves_identical_bytes_between_processes():
    seg = SharedSegment.create(1 << 20)
    owner = TransferEngine("owner", "node-a", seg, serve_tcp=True, serve_nixl=True)
    assert owner.endpoint.nixl_meta is not None
    seg.array[200_000:205_000] = payload(5000, 3)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer, args=(owner.endpoint, child))
    p.start()
    try:
        assert parent.poll(120), "the peer process did not answer"
        chosen, wrote, got, read = parent.recv()
        assert chosen == "nixl", wrote  # NIXL, not TCP, across nodes
        assert wrote == 8192 + 50 and got == 5000
        assert read == payload(5000, 3).tobytes()
        sent = payload(8192, 1)
        assert np.array_equal(seg.array[4096 : 4096 + 8192], sent)
        assert np.array_equal(seg.array[60_000:60_050], sent[100:150])
    finally:
        p.join(timeout=60)
        owner.close()
        seg.close()
