"""The OpenAI protocol's sampling fields (no server): what each request field becomes, and
every field we do not implement refused with 400 naming it, never ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.engine.outputs import TokenLogprob
from actors.serving import openai_protocol as oai
from errors import InvalidRequestError

BASE = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def api_error(cls, body) -> oai.APIError:
    try:
        req = cls.model_validate(body)
        req.sampling_params(4, 0)
    except ValidationError as e:
        return oai.validation_error(e)
    except InvalidRequestError as e:
        return oai.APIError(400, str(e), e.param)
    raise AssertionError(f"{body} was accepted")


def test_fields_become_sampling_params():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    body = dict(
        BASE,
        presence_penalty=1,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"17": 5, "3": -100},
        min_tokens=2,
        logprobs=3,
        response_format=rf,
        logprobs_mode="processed",
        ttft_slo=2.5,
    )
    p = oai.CompletionRequest.model_validate(body).sampling_params(8, 0)
    assert p.ttft_slo == 2.5
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, -0.5, 1.2)
    assert p.logit_bias == {17: 5.0, 3: -100.0} and p.min_tokens == 2 and p.logprobs == 3
    assert p.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert p.logprobs_mode == "processed"
    chat = oai.ChatCompletionRequest.model_validate(dict(CHAT, logprobs=True, top_logprobs=4))
    assert chat.sampling_params(8, 0).logprobs == 4
    assert (
        oai.ChatCompletionRequest.model_validate(dict(CHAT, logprobs=True))
        .sampling_params(8, 0)
        .logprobs
        == 0
    )
    assert oai.ChatCompletionRequest.model_validate(CHAT).sampling_params(8, 0).logprobs is None
    text = oai.ChatCompletionRequest.model_validate(dict(CHAT, response_format={"type": "text"}))
    assert text.sampling_params(8, 0).response_format is None


@pytest.mark.parametrize(
    "cls, body, param",
    [
        (oai.CompletionRequest, dict(BASE, presence_penalty=2.5), "presence_penalty"),
        (oai.CompletionRequest, dict(BASE, frequency_penalty=-2.1), "frequency_penalty"),
        (oai.CompletionRequest, dict(BASE, repetition_penalty=0), "repetition_penalty"),
        (oai.CompletionRequest, dict(BASE, logit_bias={"5": 200}), "logit_bias"),
        (oai.CompletionRequest, dict(BASE, logit_bias={"five": 1}), "logit_bias"),
        (oai.CompletionRequest, dict(BASE, min_tokens=-1), "min_tokens"),
        (oai.CompletionRequest, dict(BASE, ttft_slo=0), "ttft_slo"),
        (oai.CompletionRequest, dict(BASE, logprobs=21), "logprobs"),
        (oai.ChatCompletionRequest, dict(CHAT, top_logprobs=21, logprobs=True), "top_logprobs"),
        (oai.ChatCompletionRequest, dict(CHAT, top_logprobs=2), "top_logprobs"),
        (
            oai.CompletionRequest,
            dict(BASE, response_format={"type": "xml"}),
            "response_format.type",
        ),
        # OpenAI fields we do not implement, with a value that asks for something
        (oai.CompletionRequest, dict(BASE, best_of=2), "best_of"),
        (oai.CompletionRequest, dict(BASE, echo=True), "echo"),
        (oai.CompletionRequest, dict(BASE, suffix="end"), "suffix"),
        (oai.CompletionRequest, dict(BASE, tools=[{"type": "function"}]), "tools"),
        (oai.CompletionRequest, dict(BASE, tool_choice="required"), "tool_choice"),
        (oai.ChatCompletionRequest, dict(CHAT, tools=[{"type": "function"}]), "tools.0.function"),
        (oai.CompletionRequest, dict(BASE, made_up_field=1), "made_up_field"),
        (
            oai.CompletionRequest,
            dict(BASE, stream_options={"continuous": True}),
            "stream_options.continuous",
        ),
        (
            oai.ChatCompletionRequest,
            dict(CHAT, messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]),
            "messages.0.tool_call_id",
        ),
    ],
)
def test_bad_or_unimplemented_fields_are_400_naming_the_field(cls, body, param):
    err = api_error(cls, body)
    # a value outside a fixed set (a literal) is 422, as FastAPI answers it; the rest 400
    assert err.status == (422 if param.endswith(".type") else 400), err.message
    assert err.param == param, err.message
    assert param.split(".")[-1] in err.message


def test_neutral_values_of_unimplemented_fields_are_accepted():
    body = dict(BASE, best_of=1, echo=False, suffix=None, tools=None, store=False)
    assert oai.CompletionRequest.model_validate(body).sampling_params(4, 0).max_tokens == 4
    msgs = [{"role": "assistant", "content": "x", "tool_calls": [], "refusal": None}]
    oai.ChatCompletionRequest.model_validate(dict(CHAT, messages=msgs, tool_choice="none"))


class Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


LPS = [TokenLogprob(0, -0.5, ((0, -0.5), (1, -1.5))), TokenLogprob(2, -2.0, ((3, -0.1),))]


def test_completion_logprobs_shape():
    body = oai.completion_logprobs(LPS, Decoder(), as_ids=False, offset=3)
    assert body == {
        "tokens": ["a", "c"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"d": -0.1}],
        "text_offset": [3, 4],
    }
    ids = oai.completion_logprobs(LPS, Decoder(), as_ids=True)
    assert ids["tokens"] == ["token_id:0", "token_id:2"]
    assert ids["top_logprobs"][0] == {"token_id:0": -0.5, "token_id:1": -1.5}


def test_chat_logprobs_shape():
    body = oai.chat_logprobs(LPS, Decoder(), as_ids=False)
    first = body["content"][0]
    assert first["token"] == "a" and first["logprob"] == -0.5 and first["bytes"] == [97]
    assert first["top_logprobs"][1] == {"token": "b", "logprob": -1.5, "bytes": [98]}
