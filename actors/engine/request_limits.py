"""What makes a request unrunnable on a replica, checked before it is queued (HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass

from errors import ContextLengthError, InvalidRequestError
from policies.request import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + generated tokens
    kv_capacity_tokens: int  # the most KV one request may hold on the replica

    @staticmethod
    def tightest(limits: list[RequestLimits]) -> RequestLimits:
        """Limits every one of ``limits`` admits (replica groups behind one ingress)."""
        return RequestLimits(
            min(x.vocab_size for x in limits),
            min(x.max_model_len for x in limits),
            min(x.kv_capacity_tokens for x in limits),
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (a 400) if this request can never run here."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids must be integers in [0, {vocab}); got {bad[:5]!r}"
            )
        n, limit = len(prompt_token_ids), self.max_model_len
        if n >= limit:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the model's context is {limit}; shorten the prompt"
            )
        if n + params.max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {limit}; set max_tokens <= {limit - n}"
            )
        capacity = self.kv_capacity_tokens
        if n + params.max_tokens > capacity:
            raise ContextLengthError(
                f"prompt + max_tokens needs more KV than a replica holds for one request "
                f"({capacity} tokens); lower max_tokens"
            )
        self.validate_sampling(params)

    def validate_sampling(self, params: SamplingParams) -> None:
        """What the sampling parameters need of this model (InvalidRequestError naming the
        field): token ids of ``logit_bias`` in the vocabulary, ``min_tokens`` within
        ``max_tokens``, a ``response_format`` that compiles to a grammar."""
        vocab = self.vocab_size
        unknown = sorted(t for t in (params.logit_bias or {}) if not 0 <= t < vocab)
        if unknown:
            raise InvalidRequestError(
                f"logit_bias: token ids must be in [0, {vocab}); got {unknown[:5]}", "logit_bias"
            )
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                f"({params.max_tokens})",
                "min_tokens",
            )
        if params.response_format is not None:
            from actors.engine.structured import grammar_of

            grammar_of(params.response_format)
