"""Weights updated in place (``LLM.update_weights``) and memory handed back (``sleep`` /
``wake_up``) in process: after an update the greedy tokens are transformers' on the new
weights, no prefix cached before it is hit after it, and a bad tensor changes nothing."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from actors import LLM, SamplingParams
from errors import InvalidRequestError
from models import write_tiny_model
from models.hf_reference import hf_greedy
from models.tiny import write_perturbed_copy
from models.weight_update import SharedWeights, read_weights

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def noisy(model_dir, tmp_path_factory):
    """(the base weights plus noise, as a tensor dict; a model folder holding them)."""
    return write_perturbed_copy(model_dir, tmp_path_factory.mktemp("noisy") / "model", seed=7)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 21, 34)]


def _tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)]


def test_update_gives_transformers_tokens_on_the_new_weights(model_dir, noisy, prompts):
    tensors, noisy_dir = noisy
    before, after = (
        hf_greedy(model_dir, prompts, NEW_TOKENS),
        hf_greedy(noisy_dir, prompts, NEW_TOKENS),
    )
    assert before != after  # the noise changes the greedy tokens
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    assert _tokens(llm, prompts) == before
    llm.update_weights(tensors)
    assert _tokens(llm, prompts) == after
    # back to the stored weights, from a path (a folder of safetensors), then a file
    llm.update_weights(str(model_dir))
    assert _tokens(llm, prompts) == before
    llm.update_weights(noisy_dir / "model.safetensors")
    assert _tokens(llm, prompts) == after
    assert llm.engine.weight_version == 3


def test_a_partial_update_replaces_only_the_tensors_it_names(model_dir, noisy, prompts):
    tensors, _ = noisy
    part = {n: t for n, t in tensors.items() if ".layers.0." in n}
    mixed = load_file(str(model_dir / "model.safetensors")) | part
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    reference = LLM(model_dir, dtype=torch.float64, block_size=4)
    reference.update_weights(mixed)  # every tensor given: layer 0 noisy, the rest stored
    llm.update_weights(part)
    assert _tokens(llm, prompts) == _tokens(reference, prompts)
    assert _tokens(llm, prompts) != hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_no_prefix_cached_before_an_update_is_hit_after_it(model_dir, noisy, prompts):
    tensors, _ = noisy
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    _tokens(llm, prompts)
    warm = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert all(o.num_cached_tokens > 0 for o in warm)
    llm.update_weights(tensors)
    cold = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    again = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert all(o.num_cached_tokens > 0 for o in again)  # cached anew, at the new version
    assert [o.token_ids for o in again] == [o.token_ids for o in cold]
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"model.layers.0.mlp.gate_proj.wieght": torch.zeros(1)}, "not a tensor of this model"),
        ({"model.norm.weight": torch.zeros(3)}, r"model.norm.weight.*shape \(3,\)"),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, "model.norm.weight.*dtype"),
        ({"model.norm.weight": [1.0] * 64}, "model.norm.weight.*not a tensor"),
        ({}, "holds no tensors"),
    ],
)
def test_a_bad_tensor_is_refused_with_nothing_changed(model_dir, noisy, prompts, bad, message):
    tensors, _ = noisy
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    before = _tokens(llm, prompts)
    # a good tensor beside the bad one is not loaded either
    update = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"], **bad}
    with pytest.raises(InvalidRequestError, match=message):
        llm.update_weights(update if bad else {})
    assert llm.engine.weight_version == 0
    assert _tokens(llm, prompts) == before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_up_gives_the_same_tokens(model_dir, noisy, prompts, level):
    tensors, noisy_dir = noisy
    llm = LLM(model_dir, dtype=torch.float64, block_size=4)
    live = {n: t.clone() for n, t in tensors.items()}  # a trainer's tensors, stepped later
    llm.update_weights(live)
    for t in live.values():
        t.zero_()  # the engine keeps what it was sent, even when it rebuilds at wake_up
    kv_bytes = sum(
        t.numel() * t.element_size()
        for layer in llm.engine.executor.worker.kv_caches
        for t in layer
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    freed = llm.sleep(level)
    assert freed >= kv_bytes + (weight_bytes if level == 2 else 0)
    with pytest.raises(InvalidRequestError, match="asleep"):
        llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    llm.wake_up()
    assert _tokens(llm, prompts) == hf_greedy(noisy_dir, prompts, NEW_TOKENS)


def test_shared_weights_round_trip_every_float_dtype_without_copying():
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.randn(2, 2).half(),
    }
    shared = SharedWeights.of(tensors)
    back = read_weights(shared)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    assert back["a"].data_ptr() == shared.arrays["a"].ctypes.data  # a view, not a copy
