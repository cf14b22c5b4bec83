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
