"""The engine's greedy tokens equal Hugging Face transformers' generate on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from models import write_tiny_model
from models.hf_reference import hf_greedy

PROMPT_LENS = [5, 11, 23, 37]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), kind=request.param)


@pytest.fixture(scope="module")
def prompts(model_dir):
    rng = random.Random(1234)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts):
    return hf_greedy(model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("chunk", [1, 3, 16, None])
def test_greedy_equals_transformers(model_dir, prompts, hf_tokens, chunk):
    llm = LLM(model_dir, dtype=torch.float64, block_size=4, chunk_size=chunk, token_budget=64)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == hf_tokens
    assert llm.engine.kv.num_used_blocks == 0


def test_prefix_cache_hit_gives_same_tokens(model_dir, prompts, hf_tokens):
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == hf_tokens
    assert all(o.num_cached_tokens == 0 for o in first)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // 4 * 4 for n in PROMPT_LENS]
    assert llm.engine.kv.num_used_blocks == 0


def test_memory_pressure_keeps_tokens_exact(model_dir, prompts, hf_tokens):
    # 24 blocks of 4 tokens cannot hold all four requests at full length at once: a request
    # waits for the blocks its whole life needs (no decode is preempted).
    llm = LLM(model_dir, dtype=torch.float64, block_size=4, num_blocks=24, chunk_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == hf_tokens
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    "policy,target", [("edf", 1.0), ("lrs", 1e-4), ("ilrs", 1.0), ("ilrs", 1e-4)]
)
def test_medha_scheduling_gives_the_same_tokens(model_dir, prompts, hf_tokens, policy, target):
    # slack-ordered prefills, adaptive chunks (at most chunk_size) and prefill-prefill
    # batching: a large target runs every prompt's chunks in one step, a tiny one a single
    # prefill chunk per step beside the decodes
    llm = LLM(
        model_dir,
        dtype=torch.float64,
        block_size=4,
        token_budget=64,
        chunk_size=5,
        scheduling=policy,
        target_batch_time=target,
        min_ttft_slo=0.01,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == hf_tokens
    assert llm.engine.kv.num_used_blocks == 0
    assert llm.engine.predictor is not None and len(llm.engine.predictor.fitter.prefill) > 0
