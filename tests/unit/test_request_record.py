"""One request record, built once at the edge: its blocks are hashed exactly once along the
whole path (prompt blocks by the builder, output blocks by the KV manager as they fill),
typed events on the serving path, and one EngineConfig."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

import store.hashing
from actors import LLM, SamplingParams
from actors.engine.config import EngineConfig
from actors.engine.events import Accepted, Delta, Done
from actors.engine.replica_controller import ReplicaController
from actors.serving.colocated_engine import ColocatedEngine
from actors.serving.engine_loop import EngineLoop
from errors import ContextLengthError
from models import write_tiny_model
from policies.replica_stats import ReplicaStats

BS = 4
PROMPT = list(range(1, 19))  # 18 tokens: 4 full prompt blocks
GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


@pytest.fixture
def hashed(monkeypatch) -> Counter:
    """Every ``block_hash`` call, keyed by (parent, block tokens)."""
    calls: Counter = Counter()
    real = store.hashing.block_hash

    def counting(parent, tokens):
        calls[(parent, tuple(tokens))] += 1
        return real(parent, tokens)

    monkeypatch.setattr(store.hashing, "block_hash", counting)
    return calls


def assert_each_block_hashed_once(calls: Counter, tokens: list[int]) -> None:
    """``tokens``: prompt + output. Its computed tokens (all but the last sampled one) fill
    ``(len - 1) // BS`` blocks; each was hashed exactly once, and nothing else was."""
    assert set(calls.values()) == {1}, calls
    blocks = [tuple(tokens[i * BS : (i + 1) * BS]) for i in range((len(tokens) - 1) // BS)]
    assert [block for _, block in calls] == blocks


def test_in_process_engine_hashes_each_block_once(model_dir, hashed):
    llm = LLM(model_dir, block_size=BS)
    request = llm.builder.build(PROMPT, GREEDY)
    assert len(hashed) == len(PROMPT) // BS == len(request.block_hashes)
    llm.engine.add_request(request)
    while llm.engine.has_unfinished():
        llm.engine.step()
    out = llm.engine.release(request.request_id)
    assert len(out.token_ids) == GREEDY.max_tokens
    assert_each_block_hashed_once(hashed, PROMPT + out.token_ids)
    assert llm.engine.kv.num_used_blocks == 0


def test_serving_path_hashes_each_block_once_and_streams_typed_events(model_dir, hashed):
    engine = ColocatedEngine.build(model_dir, EngineConfig(block_size=BS))
    builder = engine.request_builder()  # what the ingress holds: the replicas' limits
    loop = EngineLoop(engine)
    try:
        requests = builder.build_choices(PROMPT, [GREEDY, GREEDY])  # n = 2: hashed once
        assert len(hashed) == len(PROMPT) // BS

        async def run() -> list:
            return [item async for item in loop.stream(requests)]

        events = asyncio.run(run())
        assert isinstance(events[0], Accepted)
        assert all(isinstance(e, Delta | Done) for e in events[1:])
        done = {e.index: e.output for e in events if isinstance(e, Done)}
        assert sorted(done) == [0, 1]
        assert done[0].token_ids == done[1].token_ids  # greedy choices agree
        # Prompt blocks: hashed once for both choices. Output blocks: once per choice, as
        # each choice's own blocks fill (here both wrote the same tokens).
        tokens = PROMPT + done[0].token_ids
        blocks = [tuple(tokens[i * BS : (i + 1) * BS]) for i in range((len(tokens) - 1) // BS)]
        assert [block for _, block in hashed] == blocks
        prompt_blocks = len(PROMPT) // BS
        assert [hashed[key] for key in hashed] == [1] * prompt_blocks + [2] * (
            len(blocks) - prompt_blocks
        )
        assert isinstance(loop.stats(), ReplicaStats)
    finally:
        loop.shutdown()
    assert engine.check_blocks() == {"kvp0": 0}


def test_limits_are_checked_once_at_the_edge(model_dir):
    engine = ReplicaController.build(model_dir, block_size=BS, max_model_len=32)
    builder = engine.request_builder()
    with pytest.raises(ContextLengthError, match="max_tokens <= 14"):
        builder.build(PROMPT, SamplingParams(max_tokens=15))
    request = builder.build(PROMPT, SamplingParams(max_tokens=14))
    assert request.seed is not None and request.block_size == BS


def test_engine_config_names_an_unknown_option():
    with pytest.raises(ValueError, match="'blok_size'"):
        EngineConfig.from_options(blok_size=8)
    assert EngineConfig.from_options(block_size=8).block_size == 8
    assert EngineConfig(max_model_len=100).context_len(64) == 64
