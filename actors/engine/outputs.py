"""What a caller gets back for one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the ``k`` most likely tokens' (best first), under
    the request's ``logprobs_mode`` (see ``SamplingParams``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "length", "stop" or "abort"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


@dataclass
class StreamDelta:
    """Tokens and text produced for one request since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
