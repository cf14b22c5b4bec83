"""Prefill and decode as two processes sharing one GPU (skipped without CUDA): the decode
process keeps its paged cache in device memory (``DeviceKVCache``) and exports it through
CUDA IPC; the prefill process maps it (``IPCRoute``) and its ``LayerStreamer`` copies each
layer's blocks device to device as the layer is computed; the decode process accepts the
receipts, admits the requests and decodes. Their greedy tokens equal the single-process
engine's on the same GPU (float64, torch attention backend).

Plain spawned processes, no Ray (the device machine has none): the glue the Ray replicas
add around these pieces (``PrefillReplica._finished``, ``DecodeReplica._admit``) is
written out here in a few lines. The same pieces run on the CPU, through the decode
worker's shared-memory segment, in ``tests/unit/test_pd_ipc_route.py``. Passed on one
H200 (tests/gpu/README.md)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
import socket
from typing import Any

import pytest
import torch

from bench.child_process import WAIT_S, expect, guarded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

OPTS: dict[str, Any] = dict(
    device="cuda",
    dtype=torch.float64,
    attention_backend="torch",
    block_size=4,
    num_blocks=64,
    token_budget=16,
    chunk_size=8,
)
NEW_TOKENS = 6


def prompts_for(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    return [
        [rng.randrange(3, 500) for _ in range(5)],
        shared + [rng.randrange(3, 500) for _ in range(11)],
        shared + [rng.randrange(3, 500) for _ in range(7)],  # prefix hit on the prefill side
        [rng.randrange(3, 500) for _ in range(30)],  # four prefill chunks
    ]


def greedy() -> Any:
    from actors.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def model_shape() -> tuple[int, int]:
    from models import tiny_model_dir
    from models.config import read_model_config

    model = read_model_config(tiny_model_dir("dense"))
    return model.num_hidden_layers, model.num_key_value_heads


def decode_cache(device: str, layers: int, heads: int) -> Any:
    """The decode worker's KV-cache provider, as ``SharedCacheWorkers`` picks it (built
    here directly: that factory asks Ray for the node id)."""
    node = socket.gethostname()
    if device == "cpu":  # a dry run of this file's plumbing without a GPU
        from actors.disagg.kv_stream import SharedKVCache

        return SharedKVCache("decode-d-0.0.0", node, (0, layers), (0, heads), export=True)
    from actors.disagg.device_kv_cache import DeviceKVCache

    return DeviceKVCache("decode-d-0.0.0", node, (0, layers), (0, heads))


def _decode(conn: Any, opts: dict[str, Any]) -> None:
    guarded(_decode_body, conn, opts)


def _decode_body(conn: Any, opts: dict[str, Any]) -> None:
    """Reserve blocks for each prompt and send the destinations (with the export); then
    accept the prefill's receipts, admit, decode, send the outputs."""
    from actors.disagg.kv_stream import KVDestination
    from actors.engine.replica_controller import ReplicaController
    from actors.engine.worker_hooks import WorkerHooks
    from store.kv_cache_ipc import accept_receipt

    layers, heads = model_shape()
    cache = decode_cache(opts["device"], layers, heads)
    c = ReplicaController.build(None, worker_hooks=WorkerHooks(kv_cache=cache), **opts)
    (target,) = c.executor.hook_info()
    export = dataclasses.replace(target.export, weight_version=c.weight_version)
    target = dataclasses.replace(target, export=export)
    build = c.request_builder()
    dests = []
    for i, prompt in enumerate(conn.recv()):
        request = build.build(prompt, greedy(), request_id=f"r{i}")
        blocks = c.reserve_prefilled(request)
        assert blocks is not None, "no room for the reservation"
        dests.append((request, KVDestination((target,), tuple(blocks))))
    conn.send(("dests", dests))
    outputs: dict[str, list[int]] = {}
    written = 0
    for key, first_token, receipts in conn.recv():
        for done in receipts:  # every block the prefill wrote is of this cache and generation
            accept_receipt(export, done)
            written += done.nbytes
        delta = c.admit_prefilled(key, first_token)
        if delta.finished:
            outputs[key] = c.release(key).token_ids
    while c.has_unfinished():
        for d in c.step():
            if d.finished:
                outputs[d.request_id] = c.release(d.request_id).token_ids
    conn.send(("outputs", outputs, written, export.device, export.place))
    conn.recv()  # the parent is done with us: exit (the prefill closed its mapping)
    c.shutdown()


def _prefill(conn: Any, opts: dict[str, Any]) -> None:
    guarded(_prefill_body, conn, opts)


def _prefill_body(conn: Any, opts: dict[str, Any]) -> None:
    """Prefill each request into the decode process's cache through its export, one at a
    time; send each first token with its receipts."""
    from actors.disagg.kv_ipc_route import IPCRoute
    from actors.disagg.kv_stream import LayerStreamer, StreamHook
    from actors.engine.replica_controller import ReplicaController
    from actors.engine.worker_hooks import PrivateKVCache, WorkerHooks
    from store.transfer import TransferEngine

    layers, heads = model_shape()
    node = socket.gethostname()
    route = IPCRoute(node, (0, layers), (0, heads), strict=True)  # never the transfer layer
    engine = TransferEngine("prefill-p", node)
    streamer = LayerStreamer(engine, opts["block_size"], (0, heads), (0, heads), route)
    hooks = WorkerHooks(PrivateKVCache(), StreamHook(streamer))
    c = ReplicaController.build(None, worker_hooks=hooks, **opts)
    admissions = []
    for request, dest in conn.recv():
        key = request.request_id
        first = dataclasses.replace(request.params, max_tokens=1, stop=[])
        dest = dataclasses.replace(dest, weight_version=c.weight_version)
        c.add_request(dataclasses.replace(request, params=first), kv_dest=dest)
        while c.has_unfinished():
            c.step()
        receipts, failed = [], {}
        for report in c.take_hook_reports():
            failed.update(report.failed)
            receipts += report.receipts.get(key, [])
        assert not failed, failed
        admissions.append((key, c.release(key).token_ids[0], tuple(receipts)))
    streamer.close()  # drops the mapping: the decode process may free its cache
    conn.send(
        ("admissions", admissions, route.opens, route.bytes_written, engine.chosen_backends())
    )
    c.shutdown()
    engine.close()


def reference(prompts: list[list[int]], opts: dict[str, Any]) -> list[list[int]]:
    from actors.engine.replica_controller import ReplicaController

    ref = ReplicaController.build(None, **opts)
    build = ref.request_builder()
    ids = [ref.add_request(build.build(p, greedy())) for p in prompts]
    while ref.has_unfinished():
        ref.step()
    out = [ref.release(i).token_ids for i in ids]
    ref.shutdown()
    return out


def run_two_processes(opts: dict[str, Any]) -> None:
    prompts = prompts_for()
    want = reference(prompts, opts)
    ctx = mp.get_context("spawn")
    to_decode, decode_end = ctx.Pipe()
    to_prefill, prefill_end = ctx.Pipe()
    decode = ctx.Process(target=_decode, args=(decode_end, opts), daemon=True)
    prefill = ctx.Process(target=_prefill, args=(prefill_end, opts), daemon=True)
    decode.start()
    prefill.start()
    try:
        to_decode.send(prompts)
        (dests,) = expect(to_decode, "dests", decode)
        to_prefill.send(dests)
        admissions, opens, ipc_bytes, backends = expect(to_prefill, "admissions", prefill)
        prefill.join(WAIT_S)
        assert prefill.exitcode == 0
        to_decode.send(admissions)
        outputs, written, device, place = expect(to_decode, "outputs", decode)
        to_decode.send("bye")
        decode.join(WAIT_S)
        assert decode.exitcode == 0
    finally:
        for proc in (decode, prefill):
            if proc.is_alive():
                proc.kill()
    print(
        f"decode cache exported on {device} {place}; the prefill mapped it {opens} time(s) "
        f"and wrote {ipc_bytes} bytes device to device (receipts: {written})"
    )
    assert opens == 1 and backends == {}  # one mapping, nothing through the transfer layer
    assert ipc_bytes > 0 and written == ipc_bytes
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == want


def test_prefill_and_decode_processes_on_one_gpu_match_the_single_process():
    run_two_processes(OPTS)
