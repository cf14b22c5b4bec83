"""The Python API: sampling, streaming, stop strings and clear errors."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from errors import ContextLengthError, InvalidRequestError
from models import write_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense"), block_size=4)


@pytest.fixture(autouse=True)
def no_blocks_leak(llm):
    yield
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_text_prompts_and_token_prompts_agree(llm):
    (by_text,) = llm.generate("hello world", GREEDY)
    ids = llm.tokenizer.encode("hello world")
    (by_ids,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 12
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)
    assert by_text.finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    a = llm.generate(["a cat", "a dog"], p)
    b = llm.generate(["a cat", "a dog"], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    others = llm.generate(["a cat"], SamplingParams(max_tokens=12, temperature=1.0, seed=8))
    assert others[0].token_ids != a[0].token_ids


def test_top_k_one_is_greedy(llm):
    p = SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=3, ignore_eos=True)
    assert llm.generate("xyz", p)[0].token_ids == llm.generate("xyz", GREEDY)[0].token_ids


def test_stream_yields_the_same_tokens(llm):
    (full,) = llm.generate("streaming", GREEDY)
    deltas = list(llm.stream("streaming", GREEDY))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text


def test_stream_closed_early_frees_blocks(llm):
    it = llm.stream("abandon me", GREEDY)
    next(it)
    it.close()


def test_stop_string_ends_text_before_it(llm):
    (full,) = llm.generate("stop here", SamplingParams(max_tokens=24, temperature=0.0))
    text = full.text
    if len(text) < 4:
        pytest.skip("the tiny model produced too little text to pick a stop string")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (out,) = llm.generate("stop here", SamplingParams(max_tokens=24, temperature=0.0, stop=stop))
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda llm: llm.generate("", GREEDY), InvalidRequestError),
        (
            lambda llm: llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY),
            InvalidRequestError,
        ),
        (lambda llm: llm.generate(prompt_token_ids=[[1, 10**6]]), InvalidRequestError),
        (lambda llm: llm.generate(prompt_token_ids=[[1, -1]]), InvalidRequestError),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=10**6)), ContextLengthError),
        (lambda llm: llm.generate(prompt_token_ids=[[5] * 5000]), ContextLengthError),
        (lambda llm: llm.generate("hi", [GREEDY, GREEDY]), InvalidRequestError),
        (lambda llm: llm.generate(), InvalidRequestError),
    ],
)
def test_bad_requests_raise_clear_errors(llm, call, error):
    with pytest.raises(error) as info:
        call(llm)
    assert len(str(info.value)) > 10


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_one_bad_prompt_fails_the_call_before_any_starts(llm):
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate(prompt_token_ids=[[1, 2, 3], []], sampling_params=GREEDY)
