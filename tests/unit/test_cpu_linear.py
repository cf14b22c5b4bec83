from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from kernels.cpu_linear import PackedLinear, can_pack, pack_linears
from models import load_model, write_tiny_model

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 7, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_packed_model_logits_match_plain(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", kind="dense")
    packed = load_model(model_dir)
    assert can_pack(packed) and pack_linears(packed) > 0
    llm_plain = LLM(model_dir, pack_weights=False)
    llm_packed = LLM(model_dir, pack_weights=True)
    packed_modules = llm_packed.engine.executor.worker.shard.modules()
    assert any(isinstance(m, PackedLinear) for m in packed_modules)
    plain_modules = llm_plain.engine.executor.worker.shard.modules()
    assert not any(isinstance(m, PackedLinear) for m in plain_modules)
    prompts = [[5 + i for i in range(n)] for n in (9, 17, 30)]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = llm_plain.generate(prompt_token_ids=prompts, sampling_params=p)
    b = llm_packed.generate(prompt_token_ids=prompts, sampling_params=p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_packed_linear_keeps_its_weight_once_and_takes_any_leading_shape():
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160)
    packed = PackedLinear(lin)
    # no plain [out, in] copy beside the packed one: the bias is its only parameter
    assert [p.shape for p in packed.parameters()] == [torch.Size([160])]
    x = torch.randn(3, 5, 96)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == (3, 5, 160)
