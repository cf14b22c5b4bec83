"""DualPath's intra-engine rule as a replica scheduler's packer, on plain data: a step is
filled in FIFO order while the runtime predictor's attention time stays within the quota,
the request that would overflow it gets the binary-searched largest chunk, the step's
decodes count first, and the scheduler's token budget and chunk cap still hold. A replica
with the option gives the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from placement.runtime_predictor import RuntimePredictor
from policies.batch_packer import PrefillCandidate
from policies.chunking import FixedChunk
from policies.dualpath import AttentionQuotaPacker
from policies.pd_costs import LinearPrefillTime
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import Sequence
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager

PAIR = 1e-6  # seconds per (new token, earlier token) pair
QUOTA = 10_000 * PAIR


def predictor(fitted: bool = True) -> RuntimePredictor:
    p = RuntimePredictor(chunk_size=32)
    if fitted:
        p.prefill_time = LinearPrefillTime(base=1e-3, per_new_token=1e-4, per_attention_pair=PAIR)
    return p


# attention pairs n * (n + context): A 50 * 50 = 2500, B 30 * 50 = 1500, C n * n
CANDIDATES = [PrefillCandidate(50, 0), PrefillCandidate(30, 20), PrefillCandidate(100, 0)]
CANDIDATES += [PrefillCandidate(10, 0)]


def test_the_predictor_prices_attention_from_its_fitted_model():
    p = predictor()
    assert p.attention_time([(50, 0), (30, 20)]) == pytest.approx(4000 * PAIR)
    assert predictor(fitted=False).attention_time([(50, 0)]) == 0.0  # cold start: none


def test_whole_requests_while_under_the_quota_then_the_largest_chunk_that_fits():
    packer = AttentionQuotaPacker(predictor(), QUOTA)
    # A and B whole (4000 pairs); C gets n with 4000 + n^2 <= 10000: 77; D waits
    assert packer.pack([], CANDIDATES, budget=1000) == [50, 30, 77, 0]
    p = predictor()
    assert p.attention_time([(50, 0), (30, 20), (77, 0)]) <= QUOTA
    assert p.attention_time([(50, 0), (30, 20), (78, 0)]) > QUOTA


def test_the_steps_decodes_count_first():
    packer = AttentionQuotaPacker(predictor(), QUOTA)
    # a decode at context 4000 is 4001 pairs: C gets n^2 <= 10000 - 8001: 44
    assert packer.pack([(1, 4000)], CANDIDATES, budget=1000) == [50, 30, 44, 0]
    # decodes alone over the quota: the first prefill still makes progress, one token
    assert packer.pack([(1, 20_000)], CANDIDATES, budget=1000) == [1, 0, 0, 0]


def test_the_token_budget_and_the_chunk_cap_still_hold():
    packer = AttentionQuotaPacker(predictor(), QUOTA)
    assert packer.pack([], CANDIDATES, budget=100) == [50, 30, 20, 0]
    assert packer.pack([], CANDIDATES, budget=0) == [0, 0, 0, 0]
    capped = AttentionQuotaPacker(predictor(), QUOTA, max_chunk=40)
    assert capped.pack([], CANDIDATES, budget=1000) == [40, 30, 40, 0]
    # before the predictor's first fit attention is free: only the budget bounds a step
    cold = AttentionQuotaPacker(predictor(fitted=False), QUOTA)
    assert cold.pack([], CANDIDATES, budget=150) == [50, 30, 70, 0]
    with pytest.raises(ValueError, match="attention_quota must be positive"):
        AttentionQuotaPacker(predictor(), 0.0)


def test_a_scheduler_with_the_packer_runs_its_chunks():
    kv = KVCacheManager(BlockPool(4096, 16), enable_prefix_caching=False)
    packer = AttentionQuotaPacker(predictor(), QUOTA)
    sched = Scheduler(SchedulerConfig(1000, 256), kv, None, FixedChunk(1000), packer)
    for rid, n in (("a", 50), ("b", 80), ("c", 40)):
        sched.add(Sequence(rid, [7] * n, 1, arrival_time=0.0))
    step = sched.schedule(0.0)
    # a 2500 pairs, b 6400 (8900 in all), c: n^2 <= 1100: 33
    assert [(s.request_id, n) for s, n in step.entries] == [("a", 50), ("b", 80), ("c", 33)]


def test_a_replica_with_an_attention_quota_gives_the_same_tokens():
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(target_batch_time=0.1, attention_quota=0.1)
    with pytest.raises(ValueError, match="attention_quota"):
        EngineConfig(attention_quota=0.0)
    opts = dict(dtype=torch.float64, block_size=4, num_blocks=64, token_budget=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((21, 9, 14))]
    outs = []
    for extra in ({}, {"attention_quota": 1e-4}):
        replica = ReplicaController.build(None, **opts, **extra)
        if extra:
            assert isinstance(replica.scheduler.packer, AttentionQuotaPacker)
        build = replica.request_builder()
        ids = [replica.add_request(build.build(p, params)) for p in prompts]
        while replica.has_unfinished():
            replica.step()
        outs.append([replica.release(i).token_ids for i in ids])
        replica.shutdown()
    assert outs[0] == outs[1]
