"""Paged attention (torch backend) against a naive dense reference, and exact state merging."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import (
    TorchAttentionBackend,
    group_sequences,
    paged_attention,
    plan_attention,
    write_kv,
)
from kernels.kv_cache import allocate_kv_cache
from kernels.merge import merge_attention_states
from kernels.registry import get_attention_backend

torch.set_num_threads(2)

BLOCK = 4
HQ, HKV, D = 8, 2, 16


def naive_attention(q, keys, values, visible, scale):
    """q [Hq, D] one query; keys/values [n, Hkv, D]; visible [n] bool -> (out [Hq, D], lse [Hq])."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # [n, Hq, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k.double()) * scale
    scores = scores.masked_fill(~visible[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[:, None])
    probs = torch.nan_to_num(probs)
    return torch.einsum("hn,nhd->hd", probs, v.double()), lse


def build_batch(seqs, num_blocks=64, seed=0, dtype=torch.float32, hq=HQ, hkv=HKV, shuffle=True):
    """seqs: list of (cached_prefix_len, chunk_len). Returns what a step needs plus the full
    per-sequence K/V (cached prefix and new tokens) for the reference. ``shuffle=False``
    hands out blocks in order (so a sequence's blocks are consecutive in the cache)."""
    gen = torch.Generator().manual_seed(seed)
    ((k_cache, v_cache),) = allocate_kv_cache(1, num_blocks, BLOCK, hkv, D, dtype, "cpu")
    if shuffle:
        free = torch.randperm(num_blocks, generator=gen).tolist()
    else:
        free = list(range(num_blocks))[::-1]
    tables, full_k, full_v, new_k, new_v, qs = [], [], [], [], [], []
    for prefix, chunk in seqs:
        ctx = prefix + chunk
        table = [free.pop() for _ in range(math.ceil(ctx / BLOCK))]
        tables.append(table)
        k = torch.randn(ctx, hkv, D, generator=gen, dtype=dtype)
        v = torch.randn(ctx, hkv, D, generator=gen, dtype=dtype)
        full_k.append(k)
        full_v.append(v)
        # the cached prefix is already in the cache; the chunk's K/V come with the step
        prefix_meta = AttentionMetadata.build([prefix], [prefix], [table], BLOCK)
        write_kv(k_cache, v_cache, k[:prefix], v[:prefix], prefix_meta.slot_mapping)
        new_k.append(k[prefix:])
        new_v.append(v[prefix:])
        qs.append(torch.randn(chunk, hq, D, generator=gen, dtype=dtype))
    meta = AttentionMetadata.build([c for _, c in seqs], [p + c for p, c in seqs], tables, BLOCK)
    write_kv(k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), meta.slot_mapping)
    return k_cache, v_cache, meta, torch.cat(qs), full_k, full_v


def reference(seqs, q, full_k, full_v, scale):
    outs, lses = [], []
    row = 0
    for (prefix, chunk), k, v in zip(seqs, full_k, full_v, strict=True):
        for i in range(chunk):
            pos = prefix + i
            visible = torch.arange(k.shape[0]) <= pos
            out, lse = naive_attention(q[row], k, v, visible, scale)
            outs.append(out)
            lses.append(lse)
            row += 1
    return torch.stack(outs), torch.stack(lses)


MIXED = [(0, 5), (7, 1), (3, 9), (12, 1), (0, 1), (16, 4)]
DECODE = [(5, 1), (0, 1), (30, 1), (8, 1)]


@pytest.mark.parametrize("seqs", [MIXED, DECODE, [(0, 13)]], ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("impl", ["auto", "native_cpu", "batched", "flash_cpu"])
def test_paged_attention_matches_naive(seqs, impl):
    scale = D**-0.5
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(seqs)
    out, lse = paged_attention(q, k_cache, v_cache, meta, scale, impl=impl)
    ref_out, ref_lse = reference(seqs, q, full_k, full_v, scale)
    assert out.shape == (q.shape[0], HQ, D) and lse.shape == (q.shape[0], HQ)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


# Decode rows of different context lengths beside chunks of 1, 3 and 16 tokens, with and
# without cached prefixes, in no particular order.
SPLIT_MIXED = [
    (0, 16),
    (37, 1),
    (5, 3),
    (100, 1),
    (16, 16),
    (0, 1),
    (63, 1),
    (9, 3),
    (200, 1),
    (31, 16),
    (2, 1),
    (44, 3),
]


@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)], ids=["gqa4", "mha", "mqa"])
@pytest.mark.parametrize("impl", ["flash_cpu", "batched"])
def test_split_groups_are_exact_in_fp64(heads, impl):
    """Decodes and chunks computed in separate groups agree with dense per-sequence softmax
    attention to fp64 precision, and with the former single padded group."""
    hq, hkv = heads
    scale = D**-0.5
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(
        SPLIT_MIXED, num_blocks=192, seed=11, dtype=torch.float64, hq=hq, hkv=hkv
    )
    plan = plan_attention(meta)
    assert len(plan.groups) > 1  # the step really is split
    out, lse = paged_attention(q, k_cache, v_cache, meta, scale, plan, impl=impl)
    ref_out, ref_lse = reference(SPLIT_MIXED, q, full_k, full_v, scale)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    padded_out, padded_lse = paged_attention(
        q, k_cache, v_cache, meta, scale, impl=impl, split=False
    )
    torch.testing.assert_close(out, padded_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, padded_lse)


def test_split_groups_fp32_through_the_backend():
    backend = TorchAttentionBackend()
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(SPLIT_MIXED, num_blocks=192, seed=5)
    out, lse = backend.attention(q, k_cache, v_cache, meta, 0.2)
    ref_out, ref_lse = reference(SPLIT_MIXED, q, full_k, full_v, 0.2)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_decodes_are_grouped_apart_from_a_long_chunk():
    rng = torch.Generator().manual_seed(0)
    decode_ctx = torch.randint(256, 321, (32,), generator=rng).tolist()
    groups = group_sequences(
        [1] * 16 + [256] + [1] * 16, decode_ctx[:16] + [256] + decode_ctx[16:], 16
    )
    assert sorted(map(sorted, groups)) == [list(range(16)) + list(range(17, 33)), [16]]
    # equal chunks (a batch of same-length prompts) stay one group
    assert group_sequences([128] * 8, [128] * 8, 16) == [list(range(8))]
    # short chunks of similar size go together; a much longer one runs alone
    groups = group_sequences([3, 1024, 3, 16, 1], [40, 1024, 7, 30, 500], 16)
    assert [1] in groups


def test_lone_sequence_with_consecutive_blocks_is_read_in_place():
    seqs = [(21, 16)]
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(
        seqs, seed=4, dtype=torch.float64, shuffle=False
    )
    plan = plan_attention(meta)
    assert plan.groups[0].first_block is not None
    out, lse = paged_attention(q, k_cache, v_cache, meta, 0.3, plan)
    ref_out, ref_lse = reference(seqs, q, full_k, full_v, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", [True, False], ids=["split", "padded"])
def test_query_offsets_in_a_split_step(split):
    """KV-parallel shards: query row i of b sees key j iff j <= offset_b + i and j < ctx_b."""
    gen = torch.Generator().manual_seed(9)
    ((k_cache, v_cache),) = allocate_kv_cache(1, 96, BLOCK, HKV, D, torch.float64, "cpu")
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    # (query_len, ctx, offset): queries past the shard, inside it, straddling its start
    shapes = [(1, 20, 40), (16, 32, 16), (3, 12, -2), (1, 9, 8), (16, 24, -5), (1, 40, 100)]
    free = torch.randperm(96, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(ctx / BLOCK))] for _, ctx, _ in shapes]
    num_tokens = sum(n for n, _, _ in shapes)
    meta = AttentionMetadata.build(
        [n for n, _, _ in shapes],
        [c for _, c, _ in shapes],
        tables,
        BLOCK,
        query_offsets=[o for _, _, o in shapes],
        slot_mapping=[-1] * num_tokens,
    )
    q = torch.randn(num_tokens, HQ, D, generator=gen, dtype=torch.float64)
    out, lse = paged_attention(q, k_cache, v_cache, meta, 0.25, split=split)
    row = 0
    for (n, ctx, offset), table in zip(shapes, tables, strict=True):
        slots = torch.tensor([table[j // BLOCK] * BLOCK + j % BLOCK for j in range(ctx)])
        keys = k_cache.view(-1, HKV, D)[slots]
        values = v_cache.view(-1, HKV, D)[slots]
        for i in range(n):
            visible = (torch.arange(ctx) <= offset + i) & (torch.arange(ctx) < ctx)
            if visible.any():  # rows that see nothing are blanked by the KV-parallel caller
                ref, ref_lse = naive_attention(q[row], keys, values, visible, 0.25)
                torch.testing.assert_close(out[row], ref, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(lse[row].double(), ref_lse, rtol=1e-6, atol=1e-6)
            row += 1


def test_backend_from_registry_writes_then_attends():
    backend = get_attention_backend("torch")
    seqs = [(3, 2), (0, 4)]
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(seqs, seed=3)
    out, lse = backend.attention(q, k_cache, v_cache, meta, 0.25)
    ref_out, ref_lse = reference(seqs, q, full_k, full_v, 0.25)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    # a second step (new metadata object) must not reuse the first step's plan
    meta2 = AttentionMetadata.build([1], [5], [meta.block_tables[0, :2].tolist()], BLOCK)
    out2, _ = backend.attention(q[:1], k_cache, v_cache, meta2, 0.25)
    ref2, _ = naive_attention(q[0], full_k[0], full_v[0], torch.ones(5, dtype=torch.bool), 0.25)
    torch.testing.assert_close(out2[0].double(), ref2, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*flashinfer.*torch"):
        get_attention_backend("nope")


def test_flashinfer_missing_is_a_clear_error():
    import torch  # noqa: F401

    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="flashinfer"):
            get_attention_backend("flashinfer")
    else:
        pytest.skip("flashinfer is installed")


@pytest.mark.parametrize("num_shards", [2, 3])
def test_merge_of_kv_shards_equals_full_attention(num_shards):
    """Decode over a sequence whose blocks are split across ranks (KV parallelism)."""
    gen = torch.Generator().manual_seed(7)
    ctx = 23
    seqs = [(ctx - 1, 1)]
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(seqs, seed=7)
    full_out, full_lse = paged_attention(q, k_cache, v_cache, meta, 0.3)
    table = meta.block_tables[0].tolist()
    cuts = sorted(torch.randperm(len(table) - 1, generator=gen)[: num_shards - 1].add(1).tolist())
    bounds = [0, *cuts, len(table)]
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        shard_ctx = min(hi * BLOCK, ctx) - lo * BLOCK  # keys this shard holds
        shard_meta = AttentionMetadata.build([1], [shard_ctx], [table[lo:hi]], BLOCK)
        out, lse = paged_attention(q, k_cache, v_cache, shard_meta, 0.3)
        outs.append(out)
        lses.append(lse)
    merged_out, merged_lse = merge_attention_states(outs, lses)
    torch.testing.assert_close(merged_out, full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse, rtol=1e-5, atol=1e-5)


def test_merge_handles_empty_partial_states():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(10, HKV, D, generator=gen)
    values = torch.randn(10, HKV, D, generator=gen)
    q = torch.randn(HQ, D, generator=gen)
    full, full_lse = naive_attention(q, keys, values, torch.ones(10, dtype=torch.bool), 0.5)
    masks = [torch.arange(10) < 6, torch.arange(10) >= 6, torch.zeros(10, dtype=torch.bool)]
    outs, lses = [], []
    for visible in masks:
        out, lse = naive_attention(q, keys, values, visible, 0.5)
        if not visible.any():
            out = torch.full_like(out, float("nan"))  # garbage where no key exists
        outs.append(out[None].float())
        lses.append(lse[None].float())
    merged, merged_lse = merge_attention_states(outs, lses)
    torch.testing.assert_close(merged[0].double(), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse[0].double(), full_lse, rtol=1e-5, atol=1e-5)
    # nothing anywhere: out 0, lse -inf
    empty, empty_lse = merge_attention_states(outs[2:] * 2, lses[2:] * 2)
    assert torch.equal(empty, torch.zeros_like(empty))
    assert torch.isneginf(empty_lse).all()


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["gathered", "in-place"])
def test_a_fresh_prompt_runs_causal_without_a_mask(heads, shuffle):
    """A lone prompt with no cached prefix takes the unmasked causal kernel (its keys padded
    to whole blocks past the prompt); a chunk after a cached prefix does not."""
    hq, hkv = heads
    seqs = [(0, 13)]  # 13 tokens in blocks of 4: 16 keys, the last 3 never seen
    k_cache, v_cache, meta, q, full_k, full_v = build_batch(
        seqs, seed=8, dtype=torch.float64, hq=hq, hkv=hkv, shuffle=shuffle
    )
    plan = plan_attention(meta)
    assert plan.groups[0].whole_prompt
    out, lse = paged_attention(q, k_cache, v_cache, meta, 0.3, plan, impl="flash_cpu")
    ref_out, ref_lse = reference(seqs, q, full_k, full_v, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    _, _, prefixed, _, _, _ = build_batch([(5, 8)], seed=8)
    assert not plan_attention(prefixed).groups[0].whole_prompt
