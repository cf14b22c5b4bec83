"""Compact weights for decode steps: block codes found exactly from the fp32 values GGUF's
Q4_1 and Q8_0 tensors dequantize to, and bf16 values found where a bf16 checkpoint was loaded
in fp32; refused for any other weight, and multiplied by the panel kernel with the same
products as the fp32 weight, the same bits for a row in any batch."""

from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from bench.bench_model import gguf_round_trip, write_bf16, write_gguf_values
from kernels.block_codes import bf16_values, block_codes
from kernels.cpu_linear import BLOCK_CODE_ROWS, PANELS, PackedLinear
from models import write_tiny_model
from models.hf_reference import hf_greedy

panels = PANELS.load()
needs_kernel = pytest.mark.skipif(
    panels is None or not panels.available(),
    reason=f"the block-code kernel needs AVX-512: {PANELS.error() or 'built without it'}",
)


Q4_1, Q8_0, BF16 = "Q4_1", "Q8_0", "bf16"


def compact(weight: torch.Tensor, form: str) -> torch.Tensor:
    """``weight``'s values in ``form``: a GGUF type's round trip, or rounded to bf16."""
    if form == BF16:
        return weight.detach().to(torch.bfloat16).float()
    return gguf_round_trip(weight, form)


def compact_linear(form: str, in_features: int, out_features: int, bias: bool = True):
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(compact(lin.weight, form))
    packed = PackedLinear(lin)
    assert (packed.bf16 is not None) == (form == BF16)
    assert (packed.blocks is not None) == (form != BF16)
    return lin, packed


def run_kernel(packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The panel kernel on any row count (``packed`` sends past 48 rows to oneDNN)."""
    bias = None if packed.bias is None else packed.bias.detach()
    if packed.blocks is not None:
        return panels.linear_blocks(x, *packed.blocks, packed.out_features, bias)
    return panels.linear_bf16(x, packed.bf16, packed.out_features, bias)


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_codes_give_back_every_weight_of_a_gguf_tensor(kind):
    torch.manual_seed(0)
    w = gguf_round_trip(torch.randn(100, 96) * 0.05, kind)
    found = block_codes(w)
    assert found is not None
    codes, scales, offsets = found
    assert codes.dtype == torch.int8 and scales.shape == offsets.shape == (100, 3)
    blocks = codes.double().view(100, 3, 32)
    decoded = blocks * scales.double()[..., None] + offsets.double()[..., None]
    assert torch.equal(decoded.float().view(100, 96), w)


def test_rows_of_both_forms_in_one_weight():
    torch.manual_seed(1)
    a = gguf_round_trip(torch.randn(8, 64), Q4_1)
    b = gguf_round_trip(torch.randn(8, 64), Q8_0)
    assert block_codes(torch.cat([a, b])) is not None


def test_other_weights_are_refused():
    torch.manual_seed(2)
    w = gguf_round_trip(torch.randn(16, 64), Q4_1)
    assert block_codes(torch.randn(16, 64)) is None  # random fp32
    nudged = w.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))  # one ulp off
    assert block_codes(nudged) is None
    assert block_codes(w[:, :48].contiguous()) is None  # K not a multiple of 32
    broken = w.clone()
    broken[0, 0] = float("nan")
    assert block_codes(broken) is None
    assert block_codes(w.double()) is None


def test_bf16_values_are_found_exactly_and_only_there():
    torch.manual_seed(5)
    w = torch.randn(40, 64).to(torch.bfloat16).float()
    found = bf16_values(w)
    assert found is not None and found.dtype == torch.bfloat16 and torch.equal(found.float(), w)
    assert bf16_values(torch.randn(40, 64)) is None  # random fp32
    nudged = w.clone()
    nudged[39, 63] = torch.nextafter(nudged[39, 63], torch.tensor(10.0))  # one ulp off
    assert bf16_values(nudged) is None
    assert bf16_values(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert bf16_values(w.double()) is None


@needs_kernel
@pytest.mark.parametrize("form", [Q4_1, BF16])
@pytest.mark.parametrize("out_features", [64, 100, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_the_fp32_product(form, out_features, bias):
    torch.manual_seed(3)
    lin, packed = compact_linear(form, 96, out_features, bias)
    if form == BF16:
        decoded = panels.decode_bf16(packed.bf16, out_features)
    else:
        decoded = panels.decode_blocks(*packed.blocks, out_features)
    assert torch.equal(decoded, lin.weight)
    for rows in (1, 4, 7, BLOCK_CODE_ROWS):
        x = torch.randn(rows, 96)
        want = torch.nn.functional.linear(x.double(), lin.weight.double(), None)
        got = packed(x).double() - (lin.bias.double() if bias else 0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("form", [Q8_0, BF16])
def test_a_row_gets_the_same_bits_in_any_batch(form):
    torch.manual_seed(4)
    lin, packed = compact_linear(form, 128, 192)
    x = torch.randn(BLOCK_CODE_ROWS, 128)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(len(x))])
    for rows in range(2, BLOCK_CODE_ROWS + 1):
        assert torch.equal(packed(x[:rows]), alone[:rows])
    y = packed(x[:3].reshape(1, 3, 128))
    assert y.shape == (1, 3, 192) and torch.equal(y[0], alone[:3])
    # past 16 rows the kernel decodes each block into a buffer instead of registers: the
    # same values and sums, so the same bits
    many = torch.cat([x] * 20)  # 320 rows: two row groups
    assert torch.equal(run_kernel(packed, many), torch.cat([alone] * 20))


@needs_kernel
def test_a_random_weight_keeps_only_onednn():
    lin = torch.nn.Linear(96, 64)
    packed = PackedLinear(lin)
    assert packed.blocks is None and packed.bf16 is None and len(packed.stored()) == 1


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_read():
    codes = torch.zeros(2, 64, 64, dtype=torch.int8)
    s = torch.ones(2, 2, 64)
    run = panels.linear_blocks
    with pytest.raises(RuntimeError, match="multiple of 32"):
        run(torch.ones(1, 48), codes[:, :48].contiguous(), s, s, 100, None)
    with pytest.raises(RuntimeError, match="last panel"):
        run(torch.ones(1, 64), codes, s, s, 200, None)
    with pytest.raises(RuntimeError, match="K = x.size"):
        run(torch.ones(1, 96), codes, s, s, 100, None)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        run(torch.ones(1, 64), codes, s[:, :1].contiguous(), s, 100, None)
    halves = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 panels must be"):
        panels.linear_bf16(torch.ones(1, 64), halves.float(), 100, None)
    with pytest.raises(RuntimeError, match="last panel"):
        panels.linear_bf16(torch.ones(1, 64), halves, 200, None)
    with pytest.raises(RuntimeError, match="K = x.size"):
        panels.linear_bf16(torch.ones(1, 96), halves, 100, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        panels.pack_bf16(torch.zeros(10, 48, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("form", ["gguf", BF16])
def test_an_engine_on_compact_weights_gives_transformers_tokens(tmp_path, form):
    """A tiny model whose weights hold Q4_1 values (the embedding Q8_0; hidden 64, so K is a
    multiple of 32), or one stored in bf16: every linear is held compactly in the engine, and
    its greedy tokens equal transformers' on the same values (its reference runs them in
    float64), decode steps through the kernel. (Q8_0 in an engine: SmolLM2's
    tied head, test_smollm2_exact.py.)"""
    model_dir = write_tiny_model(tmp_path / "m", kind="dense")
    (write_bf16 if form == BF16 else write_gguf_values)(model_dir)

    llm = LLM(model_dir, pack_weights=True)
    layers = [m for m in llm.engine.executor.worker.shard.modules() if isinstance(m, PackedLinear)]
    held = [m.bf16 if form == BF16 else m.blocks for m in layers if m.in_features % 32 == 0]
    assert held and all(h is not None for h in held)

    prompts = [[5 + i for i in range(n)] for n in (9, 17, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert ours == hf_greedy(model_dir, prompts, 8)
