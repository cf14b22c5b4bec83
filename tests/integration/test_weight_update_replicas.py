"""Weights updated in place on replica actors (``LLM(num_replicas=2).update_weights``), and
sleep / wake, on a private local Ray cluster: the greedy tokens are transformers' on the new
weights, nothing cached before an update is hit after it, a request in flight during an
update runs wholly on one version, and a request sent while asleep runs after the wake."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from actors import LLM, SamplingParams
from errors import InvalidRequestError
from models import write_tiny_model
from models.hf_reference import hf_greedy
from models.tiny import write_perturbed_copy

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 8
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the base model's folder, a folder of the same weights plus noise, those tensors)."""
    base = write_tiny_model(tmp_path_factory.mktemp("base"))
    tensors, noisy = write_perturbed_copy(base, tmp_path_factory.mktemp("noisy") / "model", 3)
    return base, noisy, tensors


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 18, 27, 33)]


def _run(llm, prompts, params=PARAMS):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def test_replicas_update_sleep_and_wake_exactly(connected_ray_cluster, folders, prompts):
    base, noisy, tensors = folders
    old, new = hf_greedy(base, prompts, NEW_TOKENS), hf_greedy(noisy, prompts, NEW_TOKENS)
    assert old != new
    llm = LLM(base, num_replicas=2, dtype=torch.float64, block_size=4)
    try:
        assert [o.token_ids for o in _run(llm, prompts)] == old
        assert sum(o.num_cached_tokens for o in _run(llm, prompts)) > 0  # cached now

        llm.update_weights(tensors)  # checked here, put in the object store once
        after = _run(llm, prompts)
        assert [o.token_ids for o in after] == new
        assert [o.num_cached_tokens for o in after] == [0] * len(prompts)

        with pytest.raises(InvalidRequestError, match=r"model.norm.weight.*shape"):
            llm.update_weights({"model.norm.weight": torch.zeros(5)})
        assert [o.token_ids for o in _run(llm, prompts)] == new

        freed = llm.sleep(2)  # KV cache and weights, both replicas
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert freed > 2 * weight_bytes
        outs: list = []
        sent = threading.Thread(target=lambda: outs.extend(_run(llm, prompts)))
        sent.start()  # held by the sleeping replicas, not refused
        llm.wake_up()
        sent.join()
        assert [o.token_ids for o in outs] == new  # the updated weights came back
    finally:
        llm.close()


@pytest.mark.parametrize("abort_in_flight", [False, True])
def test_a_request_in_flight_runs_wholly_on_one_version(
    connected_ray_cluster, folders, prompts, abort_in_flight
):
    base, noisy, tensors = folders
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    old, new = hf_greedy(base, prompts, 48), hf_greedy(noisy, prompts, 48)
    llm = LLM(base, num_replicas=2, dtype=torch.float64, block_size=4)
    try:
        outs: list = []
        running = threading.Thread(target=lambda: outs.extend(_run(llm, prompts * 3, long)))
        running.start()
        llm.update_weights(tensors, abort_in_flight=abort_in_flight)
        running.join()
        # finished on the old weights, or (aborted and run again, or sent after) the new
        for i, out in enumerate(outs):
            assert out.token_ids in (old[i % len(prompts)], new[i % len(prompts)])
        assert [o.token_ids for o in _run(llm, prompts, long)] == new
    finally:
        llm.close()
