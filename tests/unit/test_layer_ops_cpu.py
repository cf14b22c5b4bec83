"""The compiled CPU layer operators (RMSNorm, RoPE on the fused qkv output, SwiGLU's
activation) against the torch chains they replace, which match Hugging Face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import layer_ops_cpu
from kernels.activation import silu_and_mul
from kernels.norm import RMSNorm, rms_norm
from kernels.rope import RotaryEmbedding


@pytest.fixture(scope="module", autouse=True)
def built():
    assert layer_ops_cpu.EXTENSION.load() is not None, layer_ops_cpu.EXTENSION.error()


@pytest.mark.parametrize("width", [512, 37, 16])
def test_rms_norm_is_within_an_ulp_of_the_torch_chain(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(33, width, generator=gen) * 5
    weight = torch.randn(width, generator=gen)
    got = layer_ops_cpu.rms_norm(x, weight, 1e-5)
    want = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-6)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data.copy_(weight)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x.view(3, 11, width)), want.view(3, 11, width))


def test_rope_on_qkv_equals_the_torch_chain_bit_for_bit():
    """Same products, rounded before the sum as torch's separate operators do; v untouched."""
    heads, kv_heads, head_dim, tokens = 8, 2, 64, 29
    rope = RotaryEmbedding(
        head_dim,
        4096,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_ref = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k_ref = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    q_want, k_want = rope(q_ref, k_ref.reshape(tokens, kv_heads, head_dim), positions)
    v_want = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim).clone()
    with torch.inference_mode():
        q, k, v = rope.split_qkv(qkv.clone(), positions, heads, kv_heads)
    assert torch.equal(q, q_want) and torch.equal(k, k_want) and torch.equal(v, v_want)


def test_silu_and_mul_matches_torch_including_saturated_gates():
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(17, 2 * 1536 + 2 * 5, generator=gen) * 4  # width not a multiple of 16
    gate_up[0, :4] = torch.tensor([120.0, -120.0, 0.0, -300.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = layer_ops_cpu.silu_and_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    with torch.inference_mode():
        torch.testing.assert_close(silu_and_mul(gate_up), want, rtol=1e-6, atol=1e-30)


def test_bad_inputs_are_refused_with_the_reason():
    rope = RotaryEmbedding(64, 128, 10000.0)
    qkv = torch.randn(3, 4 * 64)
    with pytest.raises(RuntimeError, match="outside the table of 128"):
        layer_ops_cpu.rope_qkv_(qkv, torch.tensor([0, 5, 128]), rope.cos, rope.sin, 2, 64)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        layer_ops_cpu.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be"):
        layer_ops_cpu.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)


def test_other_dtypes_take_the_torch_chains():
    """bf16 is not compiled: the module keeps torch's path (and its rounding)."""
    x = torch.randn(5, 64).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    assert not layer_ops_cpu.usable(x)
    with torch.inference_mode():
        assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
        gate_up = torch.randn(4, 32).to(torch.bfloat16)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)
