"""Batch invariance (``EngineConfig.batch_invariant``, ``kernels/batch_invariant.py``): one
prompt's sampled tokens and logprobs are bitwise the same alone and inside a batch of 32
others, at several chunk sizes and token budgets, fp32 and bf16.

The tiny test model is invariant even without the switch (its GEMMs are too small for the
kernel choice to change), so these tests run a random-weight model of SmolLM2-135M's width
(hidden 576, 9 query / 3 KV heads of 64, intermediate 1536) with two layers, where the
default path is not, and show that too.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter
from torch import nn

from actors import LLM, SamplingParams
from actors.engine.config import EngineConfig
from actors.serving.engine_section import EngineSection
from kernels import paged_attention_cpu
from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import paged_attention
from kernels.batch_invariant import (
    BatchInvariantAttention,
    RowTiled,
    attend_tiled_torch,
    tile_linears,
)
from kernels.cpu_linear import PackedLinear, can_pack
from models import write_tiny_model

SMOL_WIDTH = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=2048,
)
# (chunk_size, token_budget): the engine's defaults, then prompts cut at other boundaries
LAYOUTS = [(None, None), (64, 96), (23, 71)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("smol_width"), kind="dense", **SMOL_WIDTH)


def _alone_and_in_batch(model_dir, dtype: str, invariant: bool, chunk, budget):
    """The target prompt's (tokens, logprobs) alone, then as request 10 of 33."""
    rng = random.Random(0)
    options: dict[str, Any] = dict(dtype=dtype, batch_invariant=invariant)
    if chunk is not None:
        options.update(chunk_size=chunk, token_budget=budget)
    llm = LLM(model_dir, **options)
    prompt = [rng.randrange(5, 2000) for _ in range(80)]
    target = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    others = [[rng.randrange(5, 2000) for _ in range(rng.randrange(3, 64))] for _ in range(32)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 6), temperature=1.0, seed=i, ignore_eos=True)
        for i in range(32)
    ]
    (alone,) = llm.generate(prompt_token_ids=[prompt], sampling_params=target)
    batch = llm.generate(
        prompt_token_ids=others[:10] + [prompt] + others[10:],
        sampling_params=params[:10] + [target] + params[10:],
    )

    def bits(out):
        return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]

    return bits(alone), bits(batch[10])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_prompt_alone_and_in_a_batch_bitwise_equal(model_dir, dtype):
    for chunk, budget in LAYOUTS:
        alone, in_batch = _alone_and_in_batch(model_dir, dtype, True, chunk, budget)
        assert alone == in_batch, (dtype, chunk, budget)
    # without the switch the bits differ (on the last layout: chunks cut at other places)
    off_alone, off_batch = _alone_and_in_batch(model_dir, dtype, False, chunk, budget)
    if dtype == "float32":  # the switch changes the arithmetic, not the model
        assert off_alone[0] == alone[0]
    if off_alone == off_batch:
        pytest.skip(f"{dtype}: the default path was invariant here too, so this proves less")


def test_row_tiles_fix_a_rows_bits():
    torch.manual_seed(0)
    linear = nn.Linear(1536, 576, bias=False)
    layers = [linear] + ([PackedLinear(linear)] if can_pack(linear) else [])
    x = torch.randn(33, 1536)
    with torch.inference_mode():
        for layer in layers:
            tiled = RowTiled(layer)
            alone = tiled(x[7:8])
            for start, stop in ((0, 9), (0, 33), (5, 33)):
                assert torch.equal(tiled(x[start:stop])[7 - start], alone[0]), (start, stop)
            torch.testing.assert_close(tiled(x), layer(x), rtol=1e-5, atol=1e-5)


def test_tile_linears_wraps_every_linear_once():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    assert tile_linears(model) == 2
    assert tile_linears(model) == 0
    assert isinstance(model[0], RowTiled) and model[0].inner.weight.shape == (8, 4)
    x = torch.randn(5, 4)
    assert model(x).shape == (5, 2)
    assert model(x[:0]).shape == (0, 2)


def _random_cache(num_blocks, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, 3, 64)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_attention_rows_independent_of_chunk_and_batch(dtype, native):
    """Sequence A (150 keys in blocks 0..9) queried as a whole prompt, as its last chunk of
    53, as one decode row, each alone and beside other sequences: its rows' bits agree."""
    if native and paged_attention_cpu.load() is None:
        pytest.skip(f"CPU attention kernels not built: {paged_attention_cpu.error()}")
    bs, ctx = 16, 150
    k_cache, v_cache = _random_cache(40, bs, dtype)
    gen = torch.Generator().manual_seed(1)
    q_all = torch.randn(ctx, 9, 64, generator=gen).to(dtype)
    table_a = list(range(10))
    others = [(1, 40, list(range(10, 13))), (30, 70, list(range(13, 18))), (7, 7, [18])]
    backend = BatchInvariantAttention(native=native)
    results = {}
    for q_len in (ctx, 53, 1):
        for with_others in (False, True):
            seqs = [(q_len, ctx, table_a)] + (others if with_others else [])
            if with_others:
                seqs = seqs[1:2] + seqs[:1] + seqs[2:]  # A second
            meta = AttentionMetadata.build(
                [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], bs
            )
            q = torch.cat(
                [
                    q_all[ctx - s[0] :] if s[2] is table_a else torch.randn(s[0], 9, 64).to(dtype)
                    for s in seqs
                ]
            )
            out, lse = backend.attention(q, k_cache, v_cache, meta, 0.125)
            first = seqs[0][0] if with_others else 0
            results[(q_len, with_others)] = (out[first : first + q_len], lse[first : first + q_len])
            if not with_others:  # close to the reference kernel
                ref_out, ref_lse = paged_attention(
                    q.float(), k_cache.float(), v_cache.float(), meta, 0.125, impl="batched"
                )
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
                torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    whole_out, whole_lse = results[(ctx, False)]
    for (q_len, _), (out, lse) in results.items():
        assert torch.equal(out, whole_out[ctx - q_len :]), (q_len, native)
        assert torch.equal(lse, whole_lse[ctx - q_len :]), (q_len, native)


def test_torch_path_matches_native_within_rounding():
    if paged_attention_cpu.load() is None:
        pytest.skip("CPU attention kernels not built")
    k_cache, v_cache = _random_cache(20, 16, torch.float32)
    meta = AttentionMetadata.build(
        [5, 1, 40], [70, 33, 40], [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10]], 16
    )
    q = torch.randn(46, 9, 64)
    native = BatchInvariantAttention().attention(q, k_cache, v_cache, meta, 0.125)
    tiled = attend_tiled_torch(q, k_cache, v_cache, meta, 0.125)
    for a, b in zip(native, tiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_serve_engine_section_takes_the_switch():
    section = TypeAdapter(EngineSection)
    assert section.validate_python({"batch_invariant": True}).batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        section.validate_python({"batch_invariant": True, "kvp": 2})


def test_layouts_it_does_not_cover_are_refused(tmp_path):
    layouts: list[dict[str, Any]] = [dict(tp=2), dict(spp=2), dict(kvp=2)]
    for layout in layouts:
        with pytest.raises(ValueError, match="batch_invariant"):
            EngineConfig(batch_invariant=True, **layout)
    moe = write_tiny_model(tmp_path / "moe", kind="moe")
    with pytest.raises(ValueError, match="batch_invariant covers dense models"):
        LLM(moe, batch_invariant=True)
