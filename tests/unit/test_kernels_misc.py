"""RoPE, RMSNorm and MoE routing against Hugging Face; KV cache allocation."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import allocate_kv_cache
from kernels.moe import combine, dispatch, route
from kernels.norm import rms_norm
from kernels.rope import RotaryEmbedding, inverse_frequencies

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
    ids=["none", "linear", "llama3"],
)
def test_rope_matches_hf(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 500000.0
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    hf_rope = LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(
        inverse_frequencies(head_dim, theta, scaling, 4096), hf_rope.inv_freq, rtol=0, atol=0
    )
    ours = RotaryEmbedding(head_dim, 4096, theta, scaling, 4096)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 100, 2047, 4095])
    q = torch.randn(len(positions), 4, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    cos, sin = hf_rope(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    our_q, our_k = ours(q, k, positions)
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1), rtol=1e-6, atol=1e-5)


def test_rms_norm_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.linspace(0.5, 1.5, 48))
    x = torch.randn(7, 48)
    assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach())
    xb = x.bfloat16()
    torch.testing.assert_close(rms_norm(xb, hf.weight.detach(), 1e-5), hf(xb).detach())


def test_moe_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts, top_k = 11, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    mats = torch.randn(experts, hidden, hidden, generator=gen)
    weights, ids = route(logits, top_k)
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, top_k, -1)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    assert torch.equal(ids, top.indices)
    plan = dispatch(ids, experts)
    assert sum(plan.counts) == tokens * top_k and plan.offsets[-1] == tokens * top_k
    grouped = x[plan.token_ids]
    expert_out = torch.empty_like(grouped)
    for e in range(experts):
        expert_out[plan.slab(e)] = grouped[plan.slab(e)] @ mats[e].T
    out = combine(expert_out, plan, weights, tokens)
    naive = torch.zeros_like(x)
    for t in range(tokens):
        for c in range(top_k):
            naive[t] += weights[t, c] * (x[t] @ mats[ids[t, c]].T)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-5)


def test_allocate_kv_cache_shapes():
    caches = allocate_kv_cache(3, 10, 16, 2, 8, torch.float16, "cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (10, 16, 2, 8) and k.dtype == torch.float16
        assert k.data_ptr() != v.data_ptr()
    with pytest.raises(ValueError):
        allocate_kv_cache(1, 0, 16, 2, 8)


def test_kernels_package_import_has_no_side_effects():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = "import sys, kernels; print(sorted(m for m in sys.modules if m.startswith('kernels')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "['kernels']"
