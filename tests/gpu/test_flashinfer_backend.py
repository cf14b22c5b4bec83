"""flashinfer backend against the torch backend on CUDA (skipped without CUDA or flashinfer)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import paged_attention
from kernels.kv_cache import allocate_kv_cache
from kernels.merge import merge_attention_states
from kernels.registry import get_attention_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
flashinfer = pytest.importorskip("flashinfer")

DEVICE = "cuda"


def random_step(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A step over ``seqs = [(cached_prefix, chunk)]`` with random caches and block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8 + sum(math.ceil((p + c) / block_size) for p, c in seqs)
    ((k_cache, v_cache),) = allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE
    )
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen).to(dtype))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil((p + c) / block_size))] for p, c in seqs]
    meta = AttentionMetadata.build(
        [c for _, c in seqs], [p + c for p, c in seqs], tables, block_size, device=DEVICE
    )
    num_tokens = sum(c for _, c in seqs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, k_cache, v_cache, meta


CASES = {
    "mixed": [(0, 17), (40, 1), (5, 33), (100, 1), (0, 1), (16, 16)],
    "decode": [(37, 1), (0, 1), (250, 1), (15, 1), (16, 1)],
    "prefill": [(0, 300)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (28, 4)], ids=["mha", "gqa4", "gqa7"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16])
def test_flashinfer_matches_torch(case, heads, dtype, block_size):
    num_heads, num_kv_heads = heads
    head_dim = 128
    q, k_cache, v_cache, meta = random_step(
        CASES[case], num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    backend = get_attention_backend("flashinfer")
    out, lse = backend.attention(q, k_cache, v_cache, meta, scale)
    # reference in float32 on the same device
    ref_out, ref_lse = paged_attention(
        q.float(), k_cache.float(), v_cache.float(), meta, scale, impl="batched"
    )
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.float(), ref_lse, rtol=1e-3, atol=tol)  # natural log


def test_flashinfer_plan_is_reused_per_step_and_redone_for_a_new_step():
    q, k_cache, v_cache, meta = random_step(CASES["mixed"], 8, 2, 64, 16, torch.float16)
    backend = get_attention_backend("flashinfer")
    first, _ = backend.attention(q, k_cache, v_cache, meta, 0.125)
    again, _ = backend.attention(q, k_cache, v_cache, meta, 0.125)  # second layer, same step
    torch.testing.assert_close(first, again)
    q2, k2, v2, meta2 = random_step(CASES["decode"], 8, 2, 64, 16, torch.float16, seed=1)
    out2, _ = backend.attention(q2, k2, v2, meta2, 0.125)
    ref2, _ = paged_attention(q2.float(), k2.float(), v2.float(), meta2, 0.125, impl="batched")
    torch.testing.assert_close(out2.float(), ref2, rtol=5e-3, atol=5e-3)


def test_flashinfer_states_merge_with_torch_states():
    """lse bases agree: a decode over two KV shards, one per backend, merges to the full one."""
    q, k_cache, v_cache, meta = random_step([(63, 1)], 8, 2, 64, 16, torch.float16)
    table = meta.block_tables[0].tolist()
    full, _ = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    m1 = AttentionMetadata.build([1], [32], [table[:2]], 16, device=DEVICE)
    m2 = AttentionMetadata.build([1], [32], [table[2:]], 16, device=DEVICE)
    out1, lse1 = get_attention_backend("flashinfer").attention(q, k_cache, v_cache, m1, 0.125)
    out2, lse2 = paged_attention(q.float(), k_cache.float(), v_cache.float(), m2, 0.125)
    merged, _ = merge_attention_states([out1.float(), out2], [lse1, lse2])
    torch.testing.assert_close(merged, full, rtol=5e-3, atol=5e-3)


def test_tiny_model_flashinfer_vs_torch_backend(tmp_path):
    from models import load_model, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "m", head_dim=64, num_attention_heads=4)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in ("torch", "flashinfer"):
        model = load_model(model_dir, torch.bfloat16, DEVICE, attention_backend=name)
        cfg = model.config
        caches = allocate_kv_cache(
            cfg.num_hidden_layers,
            8,
            16,
            cfg.num_key_value_heads,
            cfg.head_dim,
            torch.bfloat16,
            DEVICE,
        )
        outs, pos = [], 0
        for chunk in (7, 1, 32):
            meta = AttentionMetadata.build([chunk], [pos + chunk], [[3, 1, 6]], 16, device=DEVICE)
            hidden = model(
                ids[pos : pos + chunk].to(DEVICE),
                torch.arange(pos, pos + chunk, device=DEVICE),
                caches,
                meta,
            )
            outs.append(model.compute_logits(hidden))
            pos += chunk
        logits[name] = torch.cat(outs)
    diff = (logits["torch"] - logits["flashinfer"]).abs().max()
    assert diff < 0.05 * logits["torch"].abs().max()
