"""Decode steps replayed as CUDA graphs (actors/engine/decode_graphs.py) give the eager
engine's greedy tokens, and transformers' (float64 on CUDA, torch backend, tiny dense model);
the padded rows of a captured step write only the scratch block (skipped without CUDA).
Passed on one H200 (tests/gpu/README.md), except the overlapped-steps test: not run on a GPU
yet."""

from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from actors.engine.decode_graphs import DecodeGraphRunner
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from models import load_model, write_tiny_model
from models.hf_reference import hf_greedy
from models.sharding import ModelShard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT_LENS = [5, 11, 23]  # three sequences: every decode step is padded into bucket 4
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _float64_engine(model_dir, **options) -> LLM:
    return LLM(
        model_dir,
        device="cuda",
        dtype=torch.float64,
        attention_backend="torch",
        block_size=4,
        num_blocks=64,
        **options,
    )


def test_captured_decode_equals_eager_and_transformers(tmp_path):
    model_dir = write_tiny_model(tmp_path / "dense")
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    want = hf_greedy(model_dir, prompts, NEW_TOKENS)
    tokens = {}
    for graphs in (False, True):
        llm = _float64_engine(model_dir, cuda_graphs=graphs)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        tokens[graphs] = [o.token_ids for o in outs]
        runner = llm.engine.executor.worker._decode
        if graphs:
            assert runner is not None and runner.capture, runner and runner.blockers
            assert runner.num_graphs >= 1
        else:
            assert runner is None
        assert llm.engine.kv.num_used_blocks == 0
    assert tokens[False] == want
    assert tokens[True] == want


def test_overlapped_steps_on_cuda_equal_transformers(tmp_path):
    # overlap_steps (actors/engine/token_feed.py): the step ahead is replayed with its
    # tokens fed on the device from the step before, read back only after it is submitted
    model_dir = write_tiny_model(tmp_path / "dense")
    rng = random.Random(99)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    llm = _float64_engine(model_dir, cuda_graphs=True, overlap_steps=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    runner = llm.engine.executor.worker._decode
    assert runner is not None and runner.num_graphs >= 1
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert llm.engine.kv.num_used_blocks == 0


def test_captured_padded_rows_write_only_the_scratch_block(tmp_path):
    model_dir = write_tiny_model(tmp_path / "dense")
    shard = ModelShard(load_model(model_dir, torch.float64, "cuda"))
    cfg, bs, num_blocks, scratch = shard.config, 4, 16, 15
    caches = allocate_kv_cache(
        cfg.num_hidden_layers,
        num_blocks,
        bs,
        cfg.num_key_value_heads,
        cfg.head_dim,
        torch.float64,
        "cuda",
    )
    for k, v in caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    ctx, tables = [5, 2, 9], [[3, 7], [1], [4, 0, 6]]
    meta = AttentionMetadata.build([1, 1, 1], ctx, tables, bs)  # on the host, as the worker's
    ids, pos = torch.tensor([11, 22, 33]), torch.tensor([c - 1 for c in ctx])
    runner = DecodeGraphRunner(shard, caches, bs, scratch, buckets=[8])
    assert runner.capture, runner.blockers
    hidden = runner.run(ids, pos, meta).clone()
    assert runner.num_graphs == 1
    eager_meta = AttentionMetadata.build([1, 1, 1], ctx, tables, bs, device="cuda")
    eager = shard(ids.cuda(), pos.cuda(), before, eager_meta)
    torch.testing.assert_close(hidden, eager, rtol=1e-10, atol=1e-10)
    live = set(meta.slot_mapping.tolist())
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for new, old in ((k, k0), (v, v0)):
            changed = (new != old).reshape(num_blocks * bs, -1).any(dim=1).nonzero()[:, 0]
            assert all(s in live or s // bs == scratch for s in changed.tolist())
