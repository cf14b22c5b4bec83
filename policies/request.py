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

from errors import InvalidRequestError

# (temperature, top_k, top_p, seed, index of the token in the request's output)
SampleSpec = tuple[float, int, float, int, int]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None  # stop strings; not part of the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError("max_tokens must be an integer")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def spec(self, seed: int, index: int) -> SampleSpec:
        """What a worker needs to draw token ``index`` of this request."""
        return (self.temperature, self.top_k, self.top_p, seed, index)


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
