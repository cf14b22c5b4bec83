"""The compiled CPU attention kernels (decode rows, prefill chunks) against a dense fp64
reference and the gathered torch path."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import paged_attention_cpu
from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import paged_attention, plan_attention
from kernels.kv_cache import allocate_kv_cache

torch.set_num_threads(2)


def dense_reference(q, keys, values, scale):
    """q [Hq, D]; keys/values [ctx, Hkv, D] all visible -> (out [Hq, D], lse [Hq]) in fp64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hn,nhd->hd", torch.exp(scores - lse[:, None]), v), lse


def scattered_decode_step(ctxs, block_size, hq, hkv, head_dim, seed):
    """A decode step (one query per sequence) over random caches with shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(c / block_size) for c in ctxs) + 5
    ((k_cache, v_cache),) = allocate_kv_cache(1, num_blocks, block_size, hkv, head_dim)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(c / block_size))] for c in ctxs]
    meta = AttentionMetadata.build([1] * len(ctxs), ctxs, tables, block_size)
    q = torch.randn(len(ctxs), hq, head_dim, generator=gen)
    return q, k_cache, v_cache, meta, tables


def cached_kv(cache, table, ctx, block_size):
    slots = torch.tensor([table[j // block_size] * block_size + j % block_size for j in range(ctx)])
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def test_the_kernel_builds_here():
    assert paged_attention_cpu.load() is not None, paged_attention_cpu.error()


# head_dim 64 and 128 take the AVX-512 dot product where the CPU has it, 24 the scalar one.
@pytest.mark.parametrize(
    "hq,hkv,head_dim,block_size",
    [(8, 4, 64, 16), (8, 8, 64, 16), (8, 1, 128, 4), (6, 2, 24, 1), (4, 2, 64, 32)],
    ids=["gqa2", "mha", "mqa-d128", "scalar-bs1", "bs32"],
)
def test_decode_kernel_matches_dense_reference(hq, hkv, head_dim, block_size):
    ctxs = [1, 2, 17, 300, 64, 33, 129, 5]
    q, k_cache, v_cache, meta, tables = scattered_decode_step(
        ctxs, block_size, hq, hkv, head_dim, seed=3
    )
    scale = head_dim**-0.5
    out, lse = paged_attention_cpu.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale
    )
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == (len(ctxs), hq)
    for b, (ctx, table) in enumerate(zip(ctxs, tables, strict=True)):
        keys = cached_kv(k_cache, table, ctx, block_size)
        values = cached_kv(v_cache, table, ctx, block_size)
        ref_out, ref_lse = dense_reference(q[b], keys, values, scale)
        torch.testing.assert_close(out[b].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse, rtol=1e-5, atol=1e-5)


# (query rows, context, offset of the first row): a fresh prompt, a chunk after cached
# context, one row, rows cut by the context (a KV-parallel shard ends before them), rows that
# start before the shard (the first ones see nothing), a prompt of 3 rows
PREFILL_SHAPES = [(70, 70, 0), (33, 73, 40), (1, 9, 8), (12, 20, 14), (6, 4, -3), (3, 3, 0)]


def scattered_prefill(shapes, block_size, hq, hkv, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(c / block_size) for _, c, _ in shapes) + 5
    ((k_cache, v_cache),) = allocate_kv_cache(1, num_blocks, block_size, hkv, head_dim)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(c / block_size))] for _, c, _ in shapes]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(sum(n for n, _, _ in shapes), hq, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, padded


def as_long(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize(
    "hq,hkv,head_dim,block_size",
    [(8, 4, 64, 16), (8, 8, 64, 16), (8, 1, 128, 4), (6, 2, 24, 1), (4, 2, 64, 32)],
    ids=["gqa2", "mha", "mqa-d128", "scalar-bs1", "bs32"],
)
def test_prefill_kernel_matches_dense_reference(hq, hkv, head_dim, block_size):
    """Query i of a sequence sees keys 0..min(offset + i, ctx - 1): causal, and never past
    what is cached; a row that sees no key is zero with lse -inf."""
    q, k_cache, v_cache, tables, padded = scattered_prefill(
        PREFILL_SHAPES, block_size, hq, hkv, head_dim, seed=5
    )
    scale = head_dim**-0.5
    q_lens, ctxs, offsets = (as_long(list(col)) for col in zip(*PREFILL_SHAPES, strict=True))
    out, lse = paged_attention_cpu.paged_prefill_attention(
        q, k_cache, v_cache, padded, q_lens, offsets, ctxs, scale
    )
    assert out.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    row = 0
    for (n, ctx, offset), table in zip(PREFILL_SHAPES, tables, strict=True):
        keys = cached_kv(k_cache, table, ctx, block_size)
        values = cached_kv(v_cache, table, ctx, block_size)
        for i in range(n):
            seen = max(min(offset + i + 1, ctx), 0)
            if seen == 0:
                assert torch.all(out[row] == 0) and torch.all(lse[row] == float("-inf"))
            else:
                ref_out, ref_lse = dense_reference(q[row], keys[:seen], values[:seen], scale)
                torch.testing.assert_close(out[row].double(), ref_out, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(lse[row].double(), ref_lse, rtol=1e-5, atol=1e-5)
            row += 1


def test_prefill_kernel_refuses_bad_inputs_with_the_reason():
    q, k_cache, v_cache, _, padded = scattered_prefill(PREFILL_SHAPES[:2], 16, 8, 4, 64, seed=1)
    q_lens, offsets, ctxs = as_long([70, 33]), as_long([0, 40]), as_long([70, 73])
    with pytest.raises(RuntimeError, match="rows but q_lens sum to"):
        paged_attention_cpu.paged_prefill_attention(
            q[:-1], k_cache, v_cache, padded, q_lens, offsets, ctxs, 0.1
        )
    with pytest.raises(RuntimeError, match="more than its block table holds"):
        paged_attention_cpu.paged_prefill_attention(
            q, k_cache, v_cache, padded, q_lens, as_long([0, 900]), as_long([70, 1000]), 0.1
        )
    bad = padded.clone()
    bad[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention_cpu.paged_prefill_attention(
            q, k_cache, v_cache, bad, q_lens, offsets, ctxs, 0.1
        )


def test_a_mixed_step_through_the_kernels_equals_the_gathered_path():
    """Decode rows go to the decode kernel, chunks to the prefill kernel; against the
    gathered path through torch's flash kernel, one step."""
    gen = torch.Generator().manual_seed(7)
    block_size, hq, hkv, head_dim = 16, 8, 4, 64
    # (query_len, ctx): decodes of many lengths around a 96-token chunk and a 3-token one
    shapes = [(1, 40), (96, 96), (1, 257), (3, 50), (1, 1), (1, 130), (1, 77)]
    num_blocks = sum(math.ceil(c / block_size) for _, c in shapes) + 3
    ((k_cache, v_cache),) = allocate_kv_cache(1, num_blocks, block_size, hkv, head_dim)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(c / block_size))] for _, c in shapes]
    meta = AttentionMetadata.build([n for n, _ in shapes], [c for _, c in shapes], tables, 16)
    q = torch.randn(sum(n for n, _ in shapes), hq, head_dim, generator=gen)
    plan = plan_attention(meta)
    assert any(g.visible is not None for g in plan.groups)  # some group is decode rows
    assert any(g.visible is None for g in plan.groups)  # and some is not
    native = paged_attention(q, k_cache, v_cache, meta, 0.125, plan, impl="native_cpu")
    gathered = paged_attention(q, k_cache, v_cache, meta, 0.125, plan, impl="flash_cpu")
    auto = paged_attention(q, k_cache, v_cache, meta, 0.125, plan)
    for got in (native, auto):
        torch.testing.assert_close(got[0], gathered[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], gathered[1], rtol=1e-5, atol=1e-5)


def test_query_offsets_bound_what_a_decode_row_sees():
    """KV-parallel shards: a decode row at offset o sees keys 0..min(o, ctx - 1); none if o < 0."""
    gen = torch.Generator().manual_seed(2)
    block_size, hq, hkv, head_dim = 4, 8, 2, 64
    ((k_cache, v_cache),) = allocate_kv_cache(1, 40, block_size, hkv, head_dim)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    # (ctx, offset): past the shard, inside it, before it
    shapes = [(20, 40), (24, 9), (12, -3), (9, 8)]
    free = torch.randperm(40, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(c / block_size))] for c, _ in shapes]
    meta = AttentionMetadata.build(
        [1] * len(shapes),
        [c for c, _ in shapes],
        tables,
        block_size,
        query_offsets=[o for _, o in shapes],
        slot_mapping=[-1] * len(shapes),
    )
    q = torch.randn(len(shapes), hq, head_dim, generator=gen)
    out, lse = paged_attention(q, k_cache, v_cache, meta, 0.125, impl="native_cpu")
    for b, ((ctx, offset), table) in enumerate(zip(shapes, tables, strict=True)):
        seen = min(offset + 1, ctx)
        if seen <= 0:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))
            continue
        keys = cached_kv(k_cache, table, seen, block_size)
        values = cached_kv(v_cache, table, seen, block_size)
        ref_out, ref_lse = dense_reference(q[b], keys, values, 0.125)
        torch.testing.assert_close(out[b].double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_with_the_reason():
    q, k_cache, v_cache, meta, _ = scattered_decode_step([5, 9], 4, 4, 2, 64, seed=0)
    with pytest.raises(RuntimeError, match="float32"):
        paged_attention_cpu.paged_decode_attention(
            q.double(), k_cache, v_cache, meta.block_tables, meta.context_lens, 0.1
        )
    bad_tables = meta.block_tables.clone()
    bad_tables[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention_cpu.paged_decode_attention(
            q, k_cache, v_cache, bad_tables, meta.context_lens, 0.1
        )
    too_long = meta.context_lens.clone()
    too_long[0] = 1000
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        paged_attention_cpu.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, too_long, 0.1
        )


def test_peaked_softmax_matches_the_reference():
    """Scores spread over hundreds (most exponentials underflow to 0, a few dominate): the
    kernel's vectorised exponential still gives the reference's output and lse, within what
    fp32 scores of that size carry (an ulp of 300 is 3e-5)."""
    ctxs = [300, 47, 16]
    q, k_cache, v_cache, meta, tables = scattered_decode_step(ctxs, 16, 8, 4, 64, seed=11)
    q = q * 40.0
    out, lse = paged_attention_cpu.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125
    )
    for b, (ctx, table) in enumerate(zip(ctxs, tables, strict=True)):
        keys = cached_kv(k_cache, table, ctx, 16)
        values = cached_kv(v_cache, table, ctx, 16)
        ref_out, ref_lse = dense_reference(q[b], keys, values, 0.125)
        assert torch.isfinite(out[b]).all() and torch.isfinite(lse[b]).all()
        torch.testing.assert_close(out[b].double(), ref_out, rtol=1e-3, atol=2e-4)
        torch.testing.assert_close(lse[b].double(), ref_lse, rtol=1e-5, atol=1e-4)
