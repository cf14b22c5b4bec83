"""OpenAI-compatible request models, response builders and the error shape.

Requests are validated strictly (a string where a number belongs is an error, not coerced);
unknown fields are ignored, as OpenAI-compatible servers do. Extensions beyond the OpenAI
API: ``top_k``, ``ignore_eos``, ``return_token_ids`` (each choice carries ``token_ids``)
and ``session_id`` (the key of consistent-hash routing).

Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; ``param``
names the offending field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.engine.sampling import SamplingParams

MAX_STOP_SEQUENCES = 4


class _Req(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Req):
    include_usage: bool = False


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
    # extensions
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    return_token_ids: bool = False
    session_id: str | None = None

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stop

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """Choice ``i`` of a seeded request uses ``seed + i``: choices differ, reruns repeat."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop_list(),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class TextPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
    if len(errors) > 1 and first["type"] not in _RANGE_ERRORS:
        msg += f" (and {len(errors) - 1} more problems with the same field or others)"
    return APIError(status, msg, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


# -- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


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
    index: int, text: str, finish_reason: str | None, chat: bool, token_ids: list[int] | None
) -> dict[str, Any]:
    c: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
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
) -> dict[str, Any]:
    c: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        c["delta"] = delta
    else:
        c["text"] = text or ""
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def finish_reason(reason: str | None) -> str | None:
    """Engine reasons to OpenAI's: stop, length; an abort never reaches a client."""
    return {"stop": "stop", "length": "length"}.get(reason or "", reason)
