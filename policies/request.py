"""One request as every layer sees it: built once at the edge, never re-validated or re-hashed.

``SamplingParams`` validate themselves when built. ``Request`` is made by
``actors.engine.request_builder.RequestBuilder`` (the ingress, the Python API, the
disaggregated cluster) or directly by the simulator: its limits were checked and its block
hashes computed exactly once, there. Downstream (router, replica, controller, scheduler, KV
manager, prefill and decode replicas) takes it as is; the KV manager extends a copy of
``block_hashes`` as output blocks fill, it never recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from errors import InvalidRequestError

MAX_LOGPROBS = 20  # the most top logprobs one token may ask for (OpenAI's limit)
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SampleSpec:
    """What a worker needs to draw token ``index`` of one request: plain data, pickled into
    the step plan. The worker keeps no per-request state; everything that depends on the
    request's history (the counts its penalties need, the grammar's token mask, the stop
    tokens ``min_tokens`` still forbids) is computed by the replica controller, which owns
    the request's tokens, and travels here. Neutral defaults cost nothing."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    index: int  # of the token in the request's output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, times generated so far), for presence/frequency/repetition penalties
    output_counts: tuple[tuple[int, int], ...] = ()
    prompt_tokens: tuple[int, ...] = ()  # distinct prompt ids: only with repetition_penalty
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppress: tuple[int, ...] = ()  # EOS / stop ids forbidden (min_tokens not reached)
    # The grammar's allowed tokens: little-endian int32 words, bit b of word w allows token
    # 32 * w + b (llguidance's bitmask layout); None: no grammar.
    allowed: bytes | None = None
    logprobs: int | None = None  # None: none; k: the token's logprob and the k most likely
    logprobs_mode: str = "raw"

    @property
    def plain(self) -> bool:
        """Only temperature / top-k / top-p: the sampler's fast path."""
        return (
            self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and not self.suppress
            and self.allowed is None
        )


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", name)
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequestError(f"{name} must be finite, got {value!r}", name)
    return float(value)


@dataclass
class SamplingParams:
    """Sampling of one request, with vLLM's / OpenAI's semantics, applied in this order to
    the model's logits: the grammar mask of ``response_format``, ``logit_bias``,
    ``min_tokens`` (EOS and stop token ids forbidden until that many tokens), the
    repetition penalty (over prompt and generated tokens: positive logits divided by it,
    negative ones multiplied), frequency and presence penalties (over generated tokens:
    ``logit -= frequency * count + presence * (count > 0)``), then temperature, top-k and
    top-p. ``logprobs=k``: each token carries its logprob and the ``k`` most likely tokens'
    (``logprobs_mode``: "raw", the model's log-softmax before any of the above, as vLLM
    returns by default; "processed", the distribution the token was drawn from, after all
    of it; with temperature 0 that is the processed logits' log-softmax, untempered)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None  # stop strings; not part of the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 is off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_tokens: int = 0
    logprobs: int | None = None  # None, or 0..MAX_LOGPROBS top tokens besides the sampled
    logprobs_mode: str = "raw"
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"schema":
    # {...}, ...}}, or {"type": "grammar", "grammar": <lark>} (tool calls); compiled (and
    # checked) by actors/engine/structured.py at the edge
    response_format: dict[str, Any] | None = None
    # seconds from arrival to the first token this request asks for: the deadline that
    # deadline-aware scheduling (EDF, LRS, ILRS) orders prefills by; None: derived
    ttft_slo: float | None = None
    # seconds the KV store keeps this request's blocks ahead of LRU eviction after its turn
    # ends (sessions: the next turn after a tool pause); 0: ordinary LRU blocks
    kv_retention_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError("max_tokens must be an integer", "max_tokens")
        if self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        rep = _number("repetition_penalty", self.repetition_penalty)
        if rep <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 is off), got {rep}", "repetition_penalty"
            )
        self.logit_bias = self._checked_bias(self.logit_bias)
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool):
            raise InvalidRequestError("min_tokens must be an integer", "min_tokens")
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens"
            )
        lp = self.logprobs
        if lp is not None and (
            not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}", "logprobs"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}",
                "logprobs_mode",
            )
        if self.ttft_slo is not None and not _number("ttft_slo", self.ttft_slo) > 0:
            raise InvalidRequestError(
                f"ttft_slo must be a positive number of seconds, got {self.ttft_slo}", "ttft_slo"
            )
        if not _number("kv_retention_s", self.kv_retention_s) >= 0:
            raise InvalidRequestError(
                f"kv_retention_s must be >= 0 seconds, got {self.kv_retention_s}",
                "kv_retention_s",
            )
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind not in ("text", "json_object", "json_schema", "grammar"):
                raise InvalidRequestError(
                    'response_format must be {"type": "text" | "json_object" | '
                    f'"json_schema"}}, got {rf!r}',
                    "response_format",
                )
            if kind == "text":
                self.response_format = None

    @staticmethod
    def _checked_bias(bias: Any) -> dict[int, float] | None:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to biases", "logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)  # JSON object keys are strings
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            if isinstance(key, float | bool) or token < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                )
            v = _number("logit_bias", value)
            if not -100.0 <= v <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {v} for token {token}",
                    "logit_bias",
                )
            out[token] = v
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def spec(self, seed: int, index: int, **context: Any) -> SampleSpec:
        """What a worker needs to draw token ``index`` of this request; ``context``: the
        history-dependent fields of ``SampleSpec`` (``output_counts``, ``prompt_tokens``,
        ``suppress``, ``allowed``), computed by the replica controller."""
        return SampleSpec(
            self.temperature,
            self.top_k,
            self.top_p,
            seed,
            index,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            logprobs=self.logprobs,
            logprobs_mode=self.logprobs_mode,
            **context,
        )


@dataclass(frozen=True)
class Request:
    """Invariants: ``block_hashes`` are the chained hashes (salted with ``salt``) of the
    prompt's full ``block_size``-token blocks; ``seed`` is resolved (never None), so every
    replica and every retry draws the same tokens; ``params`` passed the replica group's
    limits when the record was built."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    block_size: int
    block_hashes: list[int]
    salt: str | None = None
    arrival_time: float = 0.0  # time.monotonic() of the process that built it
    tenant: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_id(self, request_id: str) -> Request:
        """The same request under another id (one choice of an ``n > 1`` request)."""
        return Request(
            request_id,
            self.prompt_token_ids,
            self.params,
            self.seed,
            self.block_size,
            self.block_hashes,
            self.salt,
            self.arrival_time,
            self.tenant,
        )
