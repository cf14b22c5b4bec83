"""The device-to-device KV route between a prefill and a decode replica on one device
(``actors.disagg.kv_ipc_route``), on the CPU: the decode worker's shared-memory cache is
exported ("shm" handles, ``kv_route="ipc"``), the prefill worker maps it and copies each
layer's blocks straight in, the decode replica accepts the receipts before admitting.
Same code as on a GPU up to the handle kind (``tests/gpu/test_pd_one_gpu.py`` runs it
there through CUDA IPC); one process, no Ray, as ``test_pd_stream.py``."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from actors.disagg.decode import DecodeReplica
from actors.disagg.device_kv_cache import DeviceKVCache
from actors.disagg.kv_ipc_route import IPCRoute, check_kv_route, prefill_route
from actors.disagg.kv_stream import SharedCacheWorkers, SharedKVCache
from actors.disagg.messages import (
    Finished,
    PrefillDone,
    PrefillFailed,
    PrefillTask,
    ReservationLost,
)
from actors.disagg.prefill import PrefillReplica
from actors.engine.collectives import Layout
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.engine.worker_hooks import CacheGeometry
from policies.request import Request
from store.hashing import chained_block_hashes
from store.kv_block_layout import KVBlockLayout
from store.kv_cache_ipc import KVHandleError, KVWriteDone

OPTS = dict(dtype=torch.float64, block_size=4, num_blocks=48, token_budget=16, chunk_size=8)
ENGINE = EngineConfig(**OPTS)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    return [
        [rng.randrange(3, 500) for _ in range(5)],
        shared + [rng.randrange(3, 500) for _ in range(11)],
        shared + [rng.randrange(3, 500) for _ in range(7)],  # local prefix hit on prefill
        [rng.randrange(3, 500) for _ in range(30)],  # four prefill chunks
    ]


@pytest.fixture(scope="module")
def colocated(prompts):
    ref = ReplicaController.build(None, **OPTS)
    build = ref.request_builder()
    ids = [ref.add_request(build.build(p, PARAMS)) for p in prompts]
    while ref.has_unfinished():
        ref.step()
    return [ref.release(i).token_ids for i in ids]


def request(key, prompt):
    return Request(key, prompt, PARAMS, 1, 4, chained_block_hashes(prompt, 4))


def wait_for(replica, kind, keys):
    got = {}
    while set(got) != set(keys):
        for e in replica.report(5.0).events:
            if isinstance(e, kind):
                got[e.key] = e
    return got


def run_pd(prefill, decode, prompts, first=0):
    keys = [f"r{first + i}" for i in range(len(prompts))]
    for key, p in zip(keys, prompts, strict=True):
        dest = decode.reserve(key, request(key, p))
        assert dest is not None
        prefill.submit(PrefillTask(key, request(key, p), dest, decode))
        wait_for(prefill, PrefillDone, [key])  # one at a time: the third hits the cache
    finished = wait_for(decode, Finished, keys)
    return [finished[k].output.token_ids for k in keys]


class KeepReceipts:
    """An admission that only keeps what it was given (the test reads the blocks)."""

    def __init__(self):
        self.receipts = {}

    def admit(self, key, first_token, first_logprob=None, cached_tokens=0, receipts=()):
        self.receipts[key] = receipts


def test_pd_through_the_exported_cache_equals_colocated(prompts, colocated):
    prefill = PrefillReplica("p", None, ENGINE)  # kv_route "auto": uses an offered export
    decode = DecodeReplica("d", None, ENGINE, kv_route="ipc")
    assert decode.targets[0].export is not None and decode.targets[0].export.device == "cpu"
    assert run_pd(prefill, decode, prompts) == colocated
    route = prefill.route
    assert route is not None and route.opens == 1  # opened once, kept for every request
    # every byte went device to device: nothing through the transfer layer
    assert prefill.engine.chosen_backends() == {}
    assert route.bytes_written > 0 and prefill.streamer.bytes_sent == route.bytes_written
    assert set(prefill.report_stats().backends.values()) == {"ipc"}

    # the streamed blocks equal the prefill cache's, and the receipts name them
    prompt, admission = prompts[3], KeepReceipts()
    dest = decode.reserve("x", request("x", prompt))
    prefill.submit(PrefillTask("x", request("x", prompt), dest, admission))
    wait_for(prefill, PrefillDone, ["x"])
    full = len(prompt) // 4
    src_blocks = prefill.kv.cached_prefix(chained_block_hashes(prompt, 4), prompt)
    assert len(src_blocks) == full
    src = prefill.cache.kv_caches
    dst = decode.controller.executor.worker.kv_caches  # the exported shared-memory cache
    for layer in range(len(src)):
        for kind in (0, 1):
            for s, d in zip(src_blocks, dest.block_ids[:full], strict=True):
                assert torch.equal(src[layer][kind][s], dst[layer][kind][d])
    receipts = admission.receipts["x"]
    prompt_blocks = dest.block_ids[: -(-len(prompt) // 4)]  # the rest is for its output
    assert receipts and {b for r in receipts for b in r.block_ids} == set(prompt_blocks)
    decode.accept_receipts(receipts)  # of the export it holds: accepted
    decode.cancel("x")
    assert prefill.check_blocks() == 0 and decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


def test_a_revoked_export_is_mapped_again_and_never_written_stale(prompts, colocated):
    prefill = PrefillReplica("p", None, ENGINE, kv_route="ipc")
    decode = DecodeReplica("d", None, ENGINE, kv_route="ipc")
    assert run_pd(prefill, decode, prompts[:1]) == colocated[:1]
    old = decode.targets[0].export
    assert old is not None and prefill.route is not None and prefill.route.opens == 1

    decode.sleep(1)  # the cache's pages are given back: the export is revoked
    decode.wake_up()
    new = decode.targets[0].export
    assert new is not None and new.generation == old.generation + 1
    assert run_pd(prefill, decode, prompts[1:2], first=1) == colocated[1:2]
    assert prefill.route.opens == 2  # the newer generation replaced the mapping

    # a destination still carrying the revoked export: refused, nothing written
    dest = decode.reserve("s", request("s", prompts[2]))
    stale = dataclasses.replace(dest, targets=(dataclasses.replace(dest.targets[0], export=old),))
    prefill.submit(PrefillTask("s", request("s", prompts[2]), stale, decode))
    (failed,) = wait_for(prefill, PrefillFailed, ["s"]).values()
    assert "revoked" in failed.why and f"generation {old.generation}" in failed.why
    decode.cancel("s")

    # a receipt of the old generation: the decode side refuses it and lets the request go
    receipt = KVWriteDone(old.exporter, old.generation, old.weight_version, (0,), 0)
    with pytest.raises(KVHandleError, match="generation 0 .* at 1"):
        decode.accept_receipts((receipt,))
    dest = decode.reserve("t", request("t", prompts[0]))
    assert dest is not None
    decode.admit("t", 7, receipts=(receipt,))
    wait_for(decode, ReservationLost, ["t"])
    assert prefill.check_blocks() == 0 and decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


def geometry(layers=2, heads=2, device="cpu"):
    return CacheGeometry(layers, 6, 4, heads, 8, torch.float32, torch.device(device))


def test_the_route_serves_only_a_cache_of_the_same_sharding_and_weights():
    cache = SharedKVCache("dec", "node", (0, 2), (0, 2), export=True)
    kv = cache.allocate(geometry())
    target = cache.describe()
    layout, cpu = KVBlockLayout.of(kv), torch.device("cpu")
    try:
        assert IPCRoute("node", (0, 2), (0, 2)).mapping(target, None, layout, cpu) is not None
        # another sharding (this worker holds one head): the transfer layer, or refused
        assert IPCRoute("node", (0, 2), (0, 1)).mapping(target, None, layout, cpu) is None
        with pytest.raises(KVHandleError, match="same sharding"):
            IPCRoute("node", (0, 2), (0, 1), strict=True).mapping(target, None, layout, cpu)
        # another node: the shared memory is not here
        assert IPCRoute("elsewhere", (0, 2), (0, 2)).mapping(target, None, layout, cpu) is None
        with pytest.raises(KVHandleError, match="node 'node'"):
            IPCRoute("elsewhere", (0, 2), (0, 2), strict=True).mapping(target, None, layout, cpu)
        # KV of other weights is wrong on any route: refused even when not strict
        with pytest.raises(KVHandleError, match="weight version None"):
            IPCRoute("node", (0, 2), (0, 2)).mapping(target, 3, layout, cpu)
        # no export offered (the decode side's route): the transfer layer
        plain = dataclasses.replace(target, export=None)
        assert IPCRoute("node", (0, 2), (0, 2)).mapping(plain, None, layout, cpu) is None
    finally:
        cache.close()
    with pytest.raises(ValueError, match="SharedKVCache"):
        DeviceKVCache("dec", "node", (0, 2), (0, 2)).allocate(geometry())
    with pytest.raises(ValueError, match="kv_route must be one of auto, ipc, transfer"):
        check_kv_route("nccl")


def test_each_side_picks_its_route_from_the_device_and_kv_route():
    """The device is a parameter: what a GPU gets is chosen (not run) on the CPU."""
    one = Layout(tp=1, spp=1)
    hooks = SharedCacheWorkers("d", 4, 2, device="cuda")((0, 0, 0), one)
    assert isinstance(hooks.kv_cache, DeviceKVCache)  # a GPU cache: exported, always
    cpu = SharedCacheWorkers("d", 4, 2, device="cpu")((0, 0, 0), one).kv_cache
    assert isinstance(cpu, SharedKVCache) and not cpu.offers_export  # CPU default: transfer layer
    with pytest.raises(ValueError, match="reached only device to device"):
        SharedCacheWorkers("d", 4, 2, device="cuda", kv_route="transfer")((0, 0, 0), one)
    route = prefill_route("auto", False, "cpu", "node", (0, 4), (0, 2))
    assert route is not None and not route.strict
    assert prefill_route("auto", True, "cpu", "node", (0, 4), (0, 2)) is None  # several workers
    assert prefill_route("transfer", False, "cpu", "node", (0, 4), (0, 2)) is None
    with pytest.raises(ValueError, match="one-worker prefill replica"):
        prefill_route("ipc", True, "cpu", "node", (0, 4), (0, 2))
    with pytest.raises(ValueError, match="device to device only"):
        prefill_route("transfer", False, "cuda", "node", (0, 4), (0, 2))
