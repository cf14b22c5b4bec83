"""Trace loaders, token synthesis from hash ids, the synthetic generator, metrics."""

from __future__ import annotations

import json

import pytest

from sim.kv_copy import copy_prefix
from sim.metrics import RequestStats, summarize
from sim.synthetic import SyntheticSpec, generate
from sim.tokens import prompt_tokens
from sim.traces import load_trace
from sim.workload import TraceRequest, scale_time
from store.block_pool import BlockPool
from store.hashing import chained_block_hashes


def test_mooncake_and_azure_loaders(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [0, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_trace(str(path), speed=2.0)
    assert [r.arrival for r in reqs] == [0.0, 1.0]
    assert reqs[0].hash_ids == (0, 1) and reqs[1].output_len == 1  # at least one token
    csv = tmp_path / "a.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n"
    )
    a = load_trace(str(csv))
    assert a[1].arrival == pytest.approx(0.052) and a[0].input_len == 4808


def test_shared_hash_ids_become_shared_prefix_blocks():
    a = TraceRequest("a", 0, 1200, 1, (5, 6, 7))
    b = TraceRequest("b", 0, 1100, 1, (5, 6, 9))
    ta, tb = prompt_tokens(a, 0), prompt_tokens(b, 1)
    assert len(ta) == 1200 and len(tb) == 1100
    ha, hb = chained_block_hashes(ta, 16), chained_block_hashes(tb, 16)
    assert ha[:64] == hb[:64]  # 1024 shared tokens = 64 blocks of 16
    assert ha[64] != hb[64]
    # Without hash ids nothing is shared.
    u, v = TraceRequest("u", 0, 64, 1), TraceRequest("v", 0, 64, 1)
    assert (
        chained_block_hashes(prompt_tokens(u, 0), 16)[0]
        != chained_block_hashes(prompt_tokens(v, 1), 16)[0]
    )


def test_synthetic_sessions_grow_their_prefix():
    reqs = generate(SyntheticSpec(num_sessions=5, turns_mean=4, seed=3))
    assert reqs == sorted(reqs, key=lambda r: r.arrival)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(r.session_id or "", []).append(r)
    grew = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r.request_id)
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.input_len > prev.input_len
            full = prev.input_len // prev.trace_block_size
            assert nxt.hash_ids[:full] == prev.hash_ids[:full]
            grew += 1
    assert grew > 0
    assert scale_time(reqs, 2.0)[-1].arrival == pytest.approx(reqs[-1].arrival / 2)


def test_tbt_is_the_mean_of_the_longest_tenth_of_gaps():
    s = RequestStats("r", 0.0, 10, 12)
    t = 1.0
    s.on_token(t)
    for gap in [0.1] * 9 + [0.5, 0.9]:  # 11 gaps: the longest 10% rounds up to 2
        t += gap
        s.on_token(t)
    s.on_finish(t)
    assert s.ttft == 1.0
    assert s.tbt == pytest.approx(0.7)
    assert s.tpot == pytest.approx(2.3 / 11)
    r = RequestStats("x", 0.0, 10, 2)
    r.on_reject("ttft_slo", 0.0)
    summary = summarize([s, r], ttft_slo=2.0, tbt_slos=(0.8, 0.5))
    assert summary.completed == 1 and summary.rejected == 1
    assert summary.attainment == {0.8: 0.5, 0.5: 0.0}


def test_copy_prefix_makes_the_destination_hit():
    bs = 4
    tokens = list(range(100, 116))
    hashes = chained_block_hashes(tokens, bs)
    src, dst = BlockPool(8, bs), BlockPool(8, bs)
    blocks = src.allocate(3)
    for i, b in enumerate(blocks):
        src.register(b, hashes[i], tokens[i * bs : (i + 1) * bs])
    src.release(blocks[::-1])
    assert copy_prefix(src, dst, hashes, tokens, 4) == 3  # the source holds only 3
    assert all(dst.contains(h) for h in hashes[:3]) and not dst.contains(hashes[3])
    assert copy_prefix(src, dst, hashes, tokens, 3) == 3  # idempotent
    assert dst.num_cached == 3
    dst.check_integrity()
    src.check_integrity()
