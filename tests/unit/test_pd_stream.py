"""Prefill/decode disaggregation in one process (no Ray): a prefill replica streams each
layer's KV into a decode replica's shared-memory cache; decoding continues from it with
exactly the colocated replica's tokens, and every block is returned."""

from __future__ import annotations

import random

import pytest
import torch

from actors.disagg.decode import DecodeReplica
from actors.disagg.kv_routes import segment_offset
from actors.disagg.kv_stream import blocks_to_stream
from actors.disagg.messages import Finished, PrefillDone, PrefillTask
from actors.disagg.prefill import PrefillReplica
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from policies.request import Request
from store.hashing import chained_block_hashes
from store.transfer.links import LinkBudget

OPTS = dict(dtype=torch.float64, block_size=4, num_blocks=48, token_budget=16, chunk_size=8)
ENGINE = EngineConfig(**OPTS)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_segment_offsets_follow_the_cache_layout():
    # layer-major, K before V, then block: consecutive blocks are consecutive pieces
    assert segment_offset(10, 64, 0, 0, 0) == 0
    assert segment_offset(10, 64, 0, 0, 3) == 3 * 64
    assert segment_offset(10, 64, 0, 1, 0) == 10 * 64
    assert segment_offset(10, 64, 2, 1, 5) == (5 * 10 + 5) * 64


def test_blocks_to_stream_covers_prefix_once_and_each_chunk():
    assert list(blocks_to_stream(0, 13, 4)) == [0, 1, 2, 3]  # first step: cached prefix + chunk
    assert list(blocks_to_stream(8 // 4, 13, 4)) == [2, 3]
    assert list(blocks_to_stream(13 // 4, 16, 4)) == [3]  # completes the partial block


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
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


def request(key, prompt, params=PARAMS):
    return Request(key, prompt, params, 1, 4, chained_block_hashes(prompt, 4))


def wait_for(replica, kind, keys):
    """Events of ``kind`` from a replica's reports until one arrived for every key."""
    got = {}
    while set(got) != set(keys):
        for e in replica.report(5.0).events:
            if isinstance(e, kind):
                got[e.key] = e
    return got


def run_pd(prefill, decode, prompts, params=PARAMS):
    """Both replicas run their own loops; the prefill replica admits into the decode one."""
    keys = [f"r{i}" for i in range(len(prompts))]
    for key, p in zip(keys, prompts, strict=True):
        dest = decode.reserve(key, request(key, p, params))
        assert dest is not None
        prefill.submit(PrefillTask(key, request(key, p, params), dest, decode))
        wait_for(prefill, PrefillDone, [key])  # one at a time: the third hits the cache
    finished = wait_for(decode, Finished, keys)
    return [finished[k].output for k in keys]


def test_pd_in_process_equals_colocated(prompts, colocated):
    prefill, decode = PrefillReplica("p", None, ENGINE), DecodeReplica("d", None, ENGINE)
    outs = run_pd(prefill, decode, prompts)
    assert [o.token_ids for o in outs] == colocated
    assert prefill.streamer.layers_sent > 0 and prefill.streamer.bytes_sent > 0
    assert prefill.check_blocks() == 0 and decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


def test_the_kv_stream_pays_the_prefill_sides_compute_link(prompts, colocated):
    budget = LinkBudget(compute_bps=20e6, chunk_bytes=16 << 10)
    prefill = PrefillReplica("p", None, ENGINE, link_budget=budget)
    decode = DecodeReplica("d", None, ENGINE)
    outs = run_pd(prefill, decode, prompts)
    assert [o.token_ids for o in outs] == colocated
    sent = prefill.streamer.bytes_sent
    assert sent > 0 and prefill.link_bytes() == {"compute": {"exec": 0, "kv": sent}}
    assert prefill.check_blocks() == 0 and decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


def test_streamed_blocks_equal_the_prefill_cache(prompts):
    prefill, decode = PrefillReplica("p", None, ENGINE), DecodeReplica("d", None, ENGINE)
    prompt = prompts[3]
    dest = decode.reserve("r", request("r", prompt))
    prefill.submit(PrefillTask("r", request("r", prompt), dest, NoAdmission()))
    wait_for(prefill, PrefillDone, ["r"])
    full = len(prompt) // 4
    hashes = chained_block_hashes(prompt, 4)
    kv = prefill.controller.one_rank_kv  # the finished prompt's blocks stay cached there
    src_blocks = kv.cached_prefix(hashes, prompt)
    assert len(src_blocks) == full
    src = prefill.cache.kv_caches
    dst = decode.controller.executor.worker.kv_caches  # the shared-memory cache
    for layer in range(len(src)):
        for kind in (0, 1):
            for s, d in zip(src_blocks[:full], dest.block_ids[:full], strict=True):
                assert torch.equal(src[layer][kind][s], dst[layer][kind][d])
    decode.cancel("r")
    assert decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


class NoAdmission:
    def admit(self, key, first_token, first_logprob=None, cached_tokens=0):
        pass  # the test reads the streamed blocks; the request is cancelled afterwards


def test_first_token_may_finish_at_admission(prompts):
    prefill, decode = PrefillReplica("p", None, ENGINE), DecodeReplica("d", None, ENGINE)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    outs = run_pd(prefill, decode, prompts[:1], one)
    assert len(outs[0].token_ids) == 1 and outs[0].finish_reason == "length"
    assert decode.check_blocks() == 0
    prefill.shutdown()
    decode.shutdown()


def test_pd_hashes_each_block_once_across_prefill_and_decode(prompts, monkeypatch):
    """Built once at the edge, a request's prompt blocks are never hashed again on either
    side; the decode side extends the chain once per output block."""
    import store.hashing

    calls: list[tuple[int, ...]] = []
    real = store.hashing.block_hash

    def counting(parent, tokens):
        calls.append(tuple(tokens))
        return real(parent, tokens)

    prefill, decode = PrefillReplica("p", None, ENGINE), DecodeReplica("d", None, ENGINE)
    monkeypatch.setattr(store.hashing, "block_hash", counting)
    prompt = prompts[3]
    req = decode.controller.request_builder().build(prompt, PARAMS, request_id="r")
    assert len(calls) == len(prompt) // 4
    dest = decode.reserve("r", req)
    prefill.submit(PrefillTask("r", req, dest, decode))
    (out,) = [e.output for e in wait_for(decode, Finished, ["r"]).values()]
    tokens = prompt + out.token_ids
    blocks = [tuple(tokens[i * 4 : (i + 1) * 4]) for i in range((len(tokens) - 1) // 4)]
    assert calls == blocks  # each computed block once, in order, nothing else
    prefill.shutdown()
    decode.shutdown()


def test_a_staged_replicas_workers_stream_through_shares_of_the_compute_link():
    from actors.disagg.kv_stream import StreamingWorkers
    from actors.engine.collectives import Layout
    from store.transfer.links import BudgetedTransfer

    budget = LinkBudget(compute_bps=20e6, chunk_bytes=16 << 10)
    hooks = StreamingWorkers("p", 16, 4, link_budget=budget)((0, 1, 0), Layout(tp=2, spp=2))
    engine = hooks.step.streamer.engine
    assert isinstance(engine, BudgetedTransfer)
    assert engine.link is not None and engine.link.rate == 5e6  # one of 4 workers
    plain = StreamingWorkers("p", 16, 4)((0, 0, 0), Layout(tp=2, spp=2)).step.streamer.engine
    assert isinstance(plain, BudgetedTransfer) and plain.link is None
    hooks.step.streamer.close()
