"""The edge of the runtime: turns a prompt and sampling parameters into a ``Request``.

The only place a request's limits are checked, its seed resolved and its block hashes
computed. The ingress, the Python API, rollouts and the replica-pool client build requests
here; every layer after them takes the record as is.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Sequence

from actors.engine.request_limits import RequestLimits
from errors import InvalidRequestError
from policies.request import Request, SamplingParams
from store.hashing import WEIGHT_VERSION_MARK, chained_block_hashes, weight_version_salt


class RequestBuilder:
    def __init__(self, block_size: int, limits: RequestLimits) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.limits = limits
        self._seeds = random.Random()

    def build(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> Request:
        """One request; raises InvalidRequestError (a 400) if it can never run."""
        (request,) = self.build_choices(
            prompt_token_ids,
            [params],
            salt=salt,
            request_ids=None if request_id is None else [request_id],
            arrival_time=arrival_time,
            tenant=tenant,
        )
        return request

    def build_each(
        self,
        token_lists: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        salt: str | None = None,
        tenant: str | None = None,
    ) -> list[Request]:
        """One request per prompt (``params[i]`` for prompt i), every one built before any
        runs; an InvalidRequestError names the prompt."""
        requests = []
        for i, (tokens, p) in enumerate(zip(token_lists, params, strict=True)):
            try:
                requests.append(self.build(tokens, p, salt=salt, tenant=tenant))
            except InvalidRequestError as e:
                raise type(e)(f"prompt {i}: {e}", e.param) from None
        return requests

    def build_choices(
        self,
        prompt_token_ids: Sequence[int],
        params: Sequence[SamplingParams],
        *,
        salt: str | None = None,
        request_ids: Sequence[str] | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
    ) -> list[Request]:
        """One request per ``params`` (the choices of an ``n > 1`` request) over one prompt:
        its block hashes are computed once and shared (a request never mutates them)."""
        tokens = list(prompt_token_ids)
        for p in params:
            self.limits.validate(tokens, p)
        if request_ids is None:
            request_ids = [f"req-{uuid.uuid4().hex[:16]}" for _ in params]
        elif len(request_ids) != len(params):
            raise ValueError("need one request id per choice")
        hashes = chained_block_hashes(tokens, self.block_size, salt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return [
            Request(
                rid,
                tokens,
                p,
                p.seed if p.seed is not None else self._seeds.getrandbits(63),
                self.block_size,
                hashes,
                salt,
                arrival,
                tenant,
            )
            for rid, p in zip(request_ids, params, strict=True)
        ]

    @staticmethod
    def at_weight_version(request: Request, version: int) -> Request:
        """``request`` as served by weights of ``version``: its salt carries the version
        and its block hashes are computed again with it, so KV computed with other weights
        is never found for it (prefix cache, store, transfers). A request already at
        ``version`` is returned as it is; one an edge built at another version (a Serve
        ingress that has not yet heard of an update, or has heard before this replica
        loaded it) is hashed again at ``version``: the weights that run a request decide
        its version. Version 0 is the stored weights (no mark in the salt)."""
        base = unversioned_salt(request.salt)
        salt = weight_version_salt(base, version) if version else base
        if salt == request.salt:
            return request
        hashes = chained_block_hashes(request.prompt_token_ids, request.block_size, salt)
        return dataclasses.replace(request, salt=salt, block_hashes=hashes)


def unversioned_salt(salt: str | None) -> str | None:
    """``salt`` without its weight-version mark (None when nothing else was in it)."""
    if salt is None or WEIGHT_VERSION_MARK not in salt:
        return salt
    return salt.split(WEIGHT_VERSION_MARK)[0] or None
