"""The ingress's gate per request: who is calling (API key -> tenant), whether the key's
rate limits and the server's pending cap admit it, and the tokens it may use.

Invariant: ``pending`` (and each key's count) is incremented once per admitted request
(``admit``) and decremented once when its response ends (``release``); tokens reserved
from a key's ``tokens_per_minute`` (``reserve``) are settled once against what the
response used (``settle``)."""

from __future__ import annotations

import time
from collections import Counter

from fastapi import Request as HTTPRequest

from actors.serving import openai_protocol as oai
from actors.serving.config import ApiKeyConfig, ServeConfig
from actors.serving.relay import retry_after_header
from policies.api_keys import KeyRing
from policies.rate_limit import RateLimited, RateLimiter


class TenantGate:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.keys: KeyRing[ApiKeyConfig] = KeyRing({k.key: k for k in cfg.api_keys})
        self.rate = RateLimiter({k.key: k.rate_limits() for k in cfg.api_keys})
        self.pending = 0
        self.per_key: Counter[str] = Counter()

    def tenant(self, request: HTTPRequest) -> ApiKeyConfig | None:
        """The caller of ``request`` (its Bearer key); None when no keys are configured."""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        return self.check_key(key)

    def check_key(self, key: str | None) -> ApiKeyConfig | None:
        if not self.keys:
            return None  # no keys configured: open, one shared (unsalted) cache
        if key is None:
            raise oai.APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
        tenant = self.keys.match(key)
        if tenant is None:
            raise oai.APIError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def rate_check(self, tenant: ApiKeyConfig | None) -> None:
        """Before the body is read: a key out of requests (or in token debt) is refused."""
        if tenant is not None:
            self._refuse(self.rate.check(tenant.key, 0, time.monotonic()), 0)

    def reserve(self, tenant: ApiKeyConfig | None, tokens: int) -> int:
        """Take one request and ``tokens`` (the most the request may use: each prompt's
        tokens plus every choice's max_tokens) from the key's limits; the tokens reserved."""
        if tenant is None:
            return 0
        self._refuse(self.rate.admit(tenant.key, tokens, time.monotonic()), tokens)
        return tokens

    def settle(self, key: str | None, reserved: int, used: int) -> None:
        if key is not None and reserved:
            self.rate.settle(key, reserved, used, time.monotonic())

    def admit(self, tenant: ApiKeyConfig | None) -> None:
        retry = {"Retry-After": str(self.cfg.limits.retry_after_s)}
        if self.pending >= self.cfg.limits.max_pending_requests:
            raise oai.APIError(429, "the server is overloaded; retry later", headers=retry)
        if tenant is not None and tenant.max_concurrent_requests is not None:
            if self.per_key[tenant.key] >= tenant.max_concurrent_requests:
                msg = f"this key allows {tenant.max_concurrent_requests} requests at once"
                raise oai.APIError(429, msg, headers=retry)
        self.pending += 1
        if tenant is not None:
            self.per_key[tenant.key] += 1

    def release(self, key: str | None) -> None:
        self.pending -= 1
        if key is not None:
            self.per_key[key] -= 1

    def _refuse(self, refused: RateLimited | None, tokens: int) -> None:
        if refused is None:
            return
        if refused.never_fits:
            raise oai.APIError(
                400,
                f"this request may use {tokens} tokens (prompt + n x max_tokens), more than "
                f"this key's tokens_per_minute of {refused.value}; lower max_tokens or n, or "
                "shorten the prompt",
                "max_tokens",
                "request_too_large",
            )
        retry = retry_after_header(refused.retry_after, self.cfg)
        raise oai.APIError(
            429,
            f"this key's {refused.limit} limit ({refused.value}) is used up; retry in {retry} s",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry},
        )
