"""OpenAI-compatible request models, response builders and the error shape.

Requests are validated strictly (a string where a number belongs is an error, not coerced).
A field this server does not implement is refused with 400 naming it, never ignored: an
OpenAI field we lack (``best_of``, ``echo``, ``suffix``, ``functions``, ...) is accepted only
with the value that asks for nothing (``NEUTRAL``), and an unknown field never.
Extensions beyond the OpenAI API, as vLLM spells them: ``top_k``, ``ignore_eos``,
``repetition_penalty``, ``min_tokens``, ``return_token_ids`` (each choice carries
``token_ids``), ``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``),
``logprobs_mode`` ("raw", the default, or "processed": see ``SamplingParams``) and
``session_id`` (a session's turns: the routing tie-break, also sent as the ``X-Session-Id``
header) and ``kv_retention_s`` (seconds the KV store keeps the turn's blocks).

Logprobs come in OpenAI's shapes: completions ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`` (``logprobs: k``), chat ``{"content": [{"token",
"logprob", "bytes", "top_logprobs"}]}`` (``logprobs: true`` and ``top_logprobs: k``).

Chat requests take OpenAI's tools (``tools``, ``tool_choice``, ``parallel_tool_calls``;
assistant ``tool_calls`` and ``tool`` messages); ``actors/serving/tool_calls.py`` checks
what needs more than a field's own value (a ``tool_choice`` naming a declared function).

Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; ``param``
names the offending field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from actors.engine.outputs import TokenLogprob
from errors import InvalidRequestError
from policies.request import MAX_LOGPROBS, SamplingParams

MAX_STOP_SEQUENCES = 4
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# OpenAI fields this server does not implement, with the values that ask for nothing: such
# a value is dropped; any other value (and any field not listed nor modelled) is a 400.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "tool_calls": (None, []),  # of a chat message
    "refusal": (None,),  # of a chat message
}


class _Req(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in NEUTRAL for k in data):
            data = {
                k: v
                for k, v in data.items()
                if k in cls.model_fields or k not in NEUTRAL or v not in NEUTRAL[k]
            }
        return data


class JsonSchemaFormat(_Req):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = self.json_schema
        return {
            "type": "json_schema",
            "json_schema": None if spec is None else {"name": spec.name, "schema": spec.schema_},
        }


class StreamOptions(_Req):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False

    def usage_per_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _Sampling(_Req):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    response_format: ResponseFormat | None = None
    # extensions
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ttft_slo: float | None = Field(None, gt=0)  # seconds to the first token (deadline order)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    session_id: str | None = None
    kv_retention_s: float | None = Field(None, ge=0)  # None: the key's or server's default

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stop

    def num_logprobs(self) -> int | None:
        """How many top logprobs each token carries (None: no logprobs)."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """Choice ``i`` of a seeded request uses ``seed + i``: choices differ, reruns repeat.
        Raises InvalidRequestError naming the field."""
        bias: dict[int, float] | None = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.strip().isdigit():
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                    )
                bias[int(key)] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            min_tokens=self.min_tokens,
            logprobs=self.num_logprobs(),
            logprobs_mode=self.logprobs_mode,
            response_format=self.response_format.as_dict() if self.response_format else None,
            ttft_slo=self.ttft_slo,
            kv_retention_s=self.kv_retention_s or 0.0,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Req):
    type: Literal["text"]
    text: str


class FunctionDef(_Req):
    """A tool's function. ``name`` and ``function`` are checked by validators (not as
    missing fields), so that a bad tool definition is a 400 naming its field."""

    name: str | None = Field(None, validate_default=True)
    description: str | None = None
    parameters: Any = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str:
        if v is None:
            raise ValueError("a function needs a name")
        if not FUNCTION_NAME.fullmatch(v):
            raise ValueError(f"function names are 1-64 of a-z, A-Z, 0-9, _ and -; got {v!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, dict) or v.get("type", "object") != "object"):
            raise ValueError('parameters must be a JSON schema of an object ({"type": "object"})')
        return v


class ToolDef(_Req):
    type: Literal["function"]
    function: FunctionDef | None = Field(None, validate_default=True)

    @field_validator("function")
    @classmethod
    def _function(cls, v: FunctionDef | None) -> FunctionDef:
        if v is None:
            raise ValueError('a tool needs "function": {"name": ..., "parameters": {...}}')
        return v


class FunctionName(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Req):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments must be a JSON object in a string: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object in a string")
        return v


class MessageToolCall(_Req):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v: list[MessageToolCall] | None, info: ValidationInfo) -> Any:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        tool = info.data.get("role") == "tool"
        if tool and v is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if not tool and v is not None:
            raise ValueError("only tool messages carry a tool_call_id")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI's default

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


# -- errors ---------------------------------------------------------------------------------
class APIError(Exception):
    """An error response: HTTP status, OpenAI error type, message, offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }


# Pydantic error types that mean "a value of the right type, out of range": 400. The rest
# (missing, wrong type, unparsable) are 422, as FastAPI answers them.
_RANGE_ERRORS = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "too_short",
    "too_long",
    "value_error",
    "extra_forbidden",
}


def validation_error(e: ValidationError) -> APIError:
    """The first problem of ``e``, naming its field as a dotted path (``messages.0.role``)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    # Unions report one error per member; prefer one that names the deepest field.
    loc = max((err["loc"] for err in errors), key=len)
    loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))
    param = ".".join(str(p) for p in loc) or None
    status = 400 if all(err["type"] in _RANGE_ERRORS for err in errors) else 422
    msg = f"{param}: {first['msg']}" if param else first["msg"]
    unsupported = [e for e in errors if e["type"] == "extra_forbidden"]
    if unsupported:  # name the field this server does not implement, never ignore it
        bad = unsupported[0]["loc"]
        param = ".".join(str(p) for p in bad)
        last = str(bad[-1])
        status = 400
        msg = (
            f"{param}: this server does not support the field {last!r}"
            + (" with this value" if last in NEUTRAL else "")
            + "; remove it"
        )
    if len(errors) > 1 and first["type"] not in _RANGE_ERRORS:
        msg += f" (and {len(errors) - 1} more problems with the same field or others)"
    return APIError(status, msg, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


# -- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """``cached_tokens`` None (not known yet, a stream's per-chunk usage): no details."""
    use: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return use


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any] | None, chat: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        body["usage"] = use
    return body


def choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    chat: bool,
    token_ids: list[int] | None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``text`` None: a chat message of tool calls alone (``content: null``)."""
    c: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            c["message"]["tool_calls"] = tool_calls
    else:
        c["text"] = text
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def chunk_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    chat: bool,
    token_ids: list[int] | None,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    c: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        c["delta"] = delta
    else:
        c["text"] = text or ""
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def finish_reason(reason: str | None) -> str | None:
    """Engine reasons to OpenAI's: stop, length; an abort never reaches a client."""
    return {"stop": "stop", "length": "length"}.get(reason or "", reason)


# -- logprobs -------------------------------------------------------------------------------
class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def token_text(tokenizer: _Decoder, token_id: int, as_ids: bool) -> str:
    """How a token is named in logprobs (``"token_id:<id>"`` with
    ``return_tokens_as_token_ids``, as vLLM does)."""
    if as_ids:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    lps: list[TokenLogprob], tokenizer: _Decoder, as_ids: bool, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completions logprobs of ``lps``; ``offset``: the text offset of the first
    (the length of the text streamed before it)."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, lp.token_id, as_ids))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(tokenizer, t, as_ids): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], tokenizer: _Decoder, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat logprobs of ``lps``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id, as_ids)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ]
    }
