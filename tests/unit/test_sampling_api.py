"""The sampling API against a reference computed here: penalties, logit_bias, min_tokens,
logprobs and response_format, greedy and seeded, from Hugging Face ``transformers``'
logits of the same (fp64) weights, processed by hand in the order ``SamplingParams``
documents (bias, min_tokens, repetition, frequency/presence, temperature)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch
import transformers

from actors import LLM, SamplingParams
from actors.engine.replica_controller import ReplicaController
from actors.engine.seeded_draw import uniform
from errors import InvalidRequestError
from models import write_tiny_model

PROMPT = [5, 9, 9, 17, 33, 5, 60, 61, 62, 9, 200, 5]
N = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype=torch.float64, block_size=4)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(torch.float64)
    model.eval()
    return model


@pytest.fixture(autouse=True)
def no_blocks_leak(llm):
    yield
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def by_hand(
    logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams, stop_ids: set[int]
) -> torch.Tensor:
    """The documented processing, one token at a time in plain Python (fp32, as sampled)."""
    x = [float(v) for v in logits.float()]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(out) < p.min_tokens:
        for t in stop_ids:
            x[t] = -math.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(out).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return torch.tensor(x, dtype=torch.float32)


def reference(hf, p: SamplingParams, seed: int = 0, stop_ids: frozenset[int] = frozenset()):
    """(tokens, processed logits per step, raw logits per step) of N tokens."""
    out: list[int] = []
    raws, procs = [], []
    for i in range(p.max_tokens):
        raw = hf_logits(hf, PROMPT + out)
        x = by_hand(raw, PROMPT, out, p, set(stop_ids))
        if p.temperature == 0:
            token = int(x.argmax())
        else:
            # inverse CDF at the request's uniform number for (seed, i)
            probs = torch.softmax(x.double() / p.temperature, dim=-1)
            target = uniform(seed, i) * float(probs.sum())
            token = next(j for j, c in enumerate(probs.cumsum(0).tolist()) if c > target)
        raws.append(raw)
        procs.append(x)
        out.append(token)
    return out, procs, raws


PENALTIES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-2.0),  # negative: the model repeats itself
    dict(frequency_penalty=-1.5, presence_penalty=1.0),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.4),
    dict(logit_bias={9: 3.5, 46: -100.0}),
    dict(logit_bias={42: 100.0}),  # forces token 42
    dict(logit_bias={9: 2.0}, repetition_penalty=1.5, frequency_penalty=0.5),
]


@pytest.mark.parametrize("kw", PENALTIES, ids=lambda kw: ",".join(kw))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalties_and_bias_match_the_reference(llm, hf, kw, temperature):
    p = SamplingParams(max_tokens=N, temperature=temperature, seed=21, ignore_eos=True, **kw)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    want, _, _ = reference(hf, p, seed=21)
    assert out.token_ids == want
    plain = dataclasses.replace(
        p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None
    )
    if kw.get("logit_bias") == {42: 100.0}:
        assert set(out.token_ids) == {42}
    elif temperature == 0:  # the knob changes something, or the test proves nothing
        assert reference(hf, plain)[0] != want


def test_a_penalized_request_is_independent_of_its_batch(llm):
    p = SamplingParams(
        max_tokens=N,
        temperature=0.7,
        seed=4,
        frequency_penalty=1.2,
        repetition_penalty=1.3,
        logprobs=2,
        ignore_eos=True,
    )
    (alone,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    others = SamplingParams(max_tokens=N, temperature=1.0, seed=5, presence_penalty=-2.0)
    batch = llm.generate(
        prompt_token_ids=[[7, 8, 9], PROMPT, PROMPT[:5]], sampling_params=[others, p, others]
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].logprobs == alone.logprobs


def test_min_tokens_suppresses_eos_and_stop_tokens(llm, hf):
    eos = llm.engine.eos_token_ids
    # A bias that makes EOS the greedy choice everywhere: it may only come at token 5.
    bias = {t: 100.0 for t in eos}
    p = SamplingParams(max_tokens=N, temperature=0.0, logit_bias=bias, min_tokens=5)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    assert out.finish_reason == "stop" and len(out.token_ids) == 6
    assert out.token_ids[-1] in eos
    want, _, _ = reference(hf, dataclasses.replace(p, max_tokens=6), stop_ids=eos)
    assert out.token_ids == want
    # stop_token_ids too, and stop strings only count once min_tokens tokens are out
    (free,) = llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
    )
    first = free.token_ids[0]
    p = SamplingParams(
        max_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=3
    )
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    assert first not in out.token_ids[:3]
    want, _, _ = reference(hf, p, stop_ids=frozenset([first]))
    k = next((i for i, t in enumerate(want) if t == first), len(want) - 1)
    assert out.token_ids == want[: k + 1]
    if free.text:  # its first character would stop it at once without min_tokens
        p = SamplingParams(
            max_tokens=N, temperature=0.0, ignore_eos=True, stop=free.text[:1], min_tokens=4
        )
        (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
        assert 4 <= len(out.token_ids) and out.token_ids == free.token_ids[: len(out.token_ids)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_raw_logprobs_are_the_models_log_softmax(llm, hf, temperature):
    """``logprobs_mode="raw"`` (the default, as vLLM): the log-softmax of the model's
    logits, before penalties, bias and temperature; the top ones best first."""
    p = SamplingParams(
        max_tokens=N,
        temperature=temperature,
        seed=3,
        ignore_eos=True,
        logprobs=5,
        presence_penalty=0.8,
        logit_bias={9: 1.0},
    )
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    want, _, raws = reference(hf, p, seed=3)
    assert out.token_ids == want and len(out.logprobs) == N
    for lp, token, raw in zip(out.logprobs, want, raws, strict=True):
        ref = torch.log_softmax(raw, dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-6)
        top = torch.topk(ref, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_processed_logprobs_are_the_sampling_distribution(llm, hf, temperature):
    p = SamplingParams(
        max_tokens=N,
        temperature=temperature,
        seed=8,
        ignore_eos=True,
        logprobs=0,
        logprobs_mode="processed",
        frequency_penalty=1.0,
        logit_bias={9: 2.5},
    )
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    want, procs, _ = reference(hf, p, seed=8)
    assert out.token_ids == want
    for lp, token, x in zip(out.logprobs, want, procs, strict=True):
        ref = torch.log_softmax(x.double() / (temperature or 1.0), dim=-1)
        assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-5) and lp.top == ()


def test_stream_carries_the_same_logprobs(llm):
    p = SamplingParams(max_tokens=N, temperature=0.5, seed=2, logprobs=1, ignore_eos=True)
    (full,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    deltas = list(llm.stream(prompt_token_ids=PROMPT, sampling_params=p))
    assert [x for d in deltas for x in d.logprobs] == full.logprobs


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(llm, temperature):
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    p = SamplingParams(max_tokens=200, temperature=temperature, seed=1, response_format=rf)
    outs = llm.generate(prompt_token_ids=[PROMPT, [3, 4, 5]], sampling_params=p)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_output_is_an_object(llm):
    p = SamplingParams(
        max_tokens=300,
        temperature=0.0,
        response_format={"type": "json_object"},
        logit_bias={ord("}") + 3: 5.0},
    )
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may not close its object in 300 tokens: it stays a prefix
        assert out.text.startswith("{")


def test_the_first_token_sampled_as_a_prefill_replica_does(model_dir):
    """A prefill replica samples the first token with max_tokens=1 (actors/disagg/
    prefill.py): penalties over the prompt, min_tokens, bias, grammar and logprobs give
    it the same token and logprob as the whole request run in one place; a decode
    replica admitting it keeps that logprob."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    p = SamplingParams(
        max_tokens=6,
        temperature=0.9,
        seed=9,
        repetition_penalty=1.7,
        min_tokens=2,
        logit_bias={9: 4.0},
        logprobs=3,
        response_format=rf,
    )
    whole = ReplicaController.build(model_dir, block_size=4)
    prefill = ReplicaController.build(model_dir, block_size=4)
    decode = ReplicaController.build(model_dir, block_size=4)
    try:
        outs = []
        for c, first_only in ((whole, False), (prefill, True)):
            request = c.request_builder().build(PROMPT, p, request_id="r")
            if first_only:  # as PrefillReplica._start does
                first = dataclasses.replace(p, max_tokens=1, stop=[])
                request = dataclasses.replace(request, params=first)
            c.add_request(request)
            while c.has_unfinished():
                c.step()
            outs.append(c.release("r"))
        assert outs[1].token_ids == outs[0].token_ids[:1]
        assert outs[1].logprobs == outs[0].logprobs[:1]
        request = decode.request_builder().build(PROMPT, p, request_id="r")
        assert decode.reserve_prefilled(request) is not None
        delta = decode.admit_prefilled("r", outs[1].token_ids[0], outs[1].logprobs[0])
        assert delta.logprobs == outs[1].logprobs
        decode.abort("r")
        assert decode.release("r").logprobs == outs[1].logprobs
    finally:
        for c in (whole, prefill, decode):
            c.shutdown()


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs_mode": "fancy"}, "logprobs_mode"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_bad_sampling_fields_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**kw)
    assert info.value.param == field


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_fields_the_model_cannot_take_are_refused_at_the_edge(llm, kw, field):
    with pytest.raises(InvalidRequestError, match=field) as info:
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(**kw))
    assert info.value.param == field
