"""DualPath's inter-engine rules in the live Conductor (``PDClusterConfig(scheduler="dualpath")``).

The rules themselves are ``policies.dualpath.schedule`` (the simulator calls the same
function): the prefill replica by the disk-read queue of its node and its unfinished
tokens (thresholds alpha and beta), the decode replica by the Z rule, and the side that
reads the stored prefix by the shorter read queue. This module only turns what the
Conductor knows into the rule's plain inputs and its answer into a placement:

- a prefill replica (PE) reports ``tok_e`` = its queued uncomputed prompt tokens
  (``PrefillInstance.queued_tokens``: the last report, grown by each placement since) and
  ``seq_e`` = the attempts the Conductor has in prefill there;
- a decode replica (DE) reports ``seq_e`` = running + pending requests, ``tok_e`` = the
  tokens of KV it holds or has reserved and ``free`` = the tokens its free blocks hold
  (``DecodeInstance``); all DEs form one group;
- each replica stands for its own node's storage link, so its read queue is the tokens of
  stored prefix being read on it (``ReadPaths.queue``, kept in blocks, times the block
  size).

alpha and beta come from the Conductor's (refitted) cost model unless fixed: alpha = the
tokens its measured store-load bandwidth reads in 3 s, beta = the tokens its prefill model
computes in 5 s (at a ``REFERENCE_TOKENS``-token prompt).

Requests are placed one at a time, as they arrive or come back for a retry, so the rule
runs on a one-request queue; a request no PE or no DE can take is turned away (429) and
retried, which keeps the paper's "stop at the first request that cannot be placed" for
that request.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.disagg.conductor import RequestRejected
from policies.conductor import (
    Conductor,
    ConductorDecision,
    ConductorRequest,
    DecodeInstance,
    PrefillInstance,
)
from policies.dualpath import (
    DECODE_PATH,
    PREFILL_PATH,
    Assignment,
    EngineLoad,
    WaitingRequest,
    pick_prefill,
    read_threshold,
    schedule,
    work_threshold,
)

SCHEDULERS = ("mooncake", "dualpath")
REFERENCE_TOKENS = 512  # prompt length at which the prefill rate (for beta) is taken


def prefill_load(view: PrefillInstance, in_prefill: int) -> EngineLoad:
    """A prefill replica as the rule sees it (its node: itself)."""
    return EngineLoad(view.instance_id, view.instance_id, in_prefill, max(0, view.queued_tokens))


def decode_load(view: DecodeInstance, block_size: int) -> EngineLoad:
    """A decode replica as the rule sees it: held + reserved tokens, free tokens."""
    held = view.used_blocks + view.pending_blocks
    free = max(0, view.total_blocks - held)
    return EngineLoad(
        view.instance_id,
        view.instance_id,
        view.num_running + view.pending,
        held * block_size,
        free * block_size,
    )


def fitted_thresholds(conductor: Conductor, block_size: int) -> tuple[int, int]:
    """(alpha, beta) from the Conductor's cost model: tokens read in 3 s on one storage
    link, tokens one prefill replica computes in 5 s."""
    read_s = conductor.transfer_time(1)
    compute_s = conductor.prefill_time(REFERENCE_TOKENS, 0)
    if read_s <= 0 or compute_s <= 0:
        raise ValueError("the Conductor's transfer and prefill estimates must be positive")
    return (
        read_threshold(block_size / read_s),
        work_threshold(REFERENCE_TOKENS / compute_s),
    )


class DualPathPlacer:
    """Places one request by DualPath's rules. ``read_path``: "dual" takes the rule's
    side, "prefill" / "decode" a fixed one. ``thresholds``: fixed (alpha, beta) in tokens,
    else from the Conductor's cost model at each placement."""

    def __init__(
        self, block_size: int, read_path: str, thresholds: tuple[int, int] | None = None
    ) -> None:
        if thresholds is not None and min(thresholds) < 0:
            raise ValueError(f"dualpath thresholds (alpha, beta) must be >= 0, got {thresholds}")
        self.block_size = block_size
        self.read_path = read_path
        self.thresholds = thresholds

    def place(
        self,
        request: WaitingRequest,
        prefills: Sequence[EngineLoad],
        decodes: Sequence[EngineLoad],
        read_queues: dict[str, int],
        conductor: Conductor,
        read_rates: dict[str, float] | None = None,
    ) -> Assignment:
        """The (PE, DE, read path) for ``request``; raises ``RequestRejected`` when every
        PE is over beta ("prefill_busy") or no DE has the room ("decode_full").
        ``read_rates``: tokens per second each replica's storage link reads (None: all
        alike)."""
        alpha, beta = self.thresholds or fitted_thresholds(conductor, self.block_size)
        dual = self.read_path == "dual"
        out = schedule(
            [request], prefills, decodes, read_queues, alpha, beta, dual, read_rates=read_rates
        )
        if not out.assignments:
            busy = pick_prefill(prefills, read_queues, alpha, beta) is None
            reason = "prefill_busy" if busy else "decode_full"
            raise RequestRejected(reason, conductor.min_retry_after)
        a = out.assignments[0]
        if dual or self.read_path == PREFILL_PATH:
            return a
        return Assignment(a.request_id, a.prefill, a.decode, DECODE_PATH, a.decode)

    def decide(
        self,
        request: ConductorRequest,
        hit_blocks: int,
        prefills: Sequence[PrefillInstance],
        in_prefill: dict[str, int],
        decodes: Sequence[DecodeInstance],
        read_queues: dict[str, int],
        conductor: Conductor,
        read_rates: dict[str, float] | None = None,
    ) -> tuple[ConductorDecision, Assignment]:
        """``place`` on the Conductor's views; the decision (its ``cached_blocks``: the
        stored prefix read) updates the views as any accepted one (``apply_decision``).
        ``in_prefill``: attempts in prefill per prefill replica; ``read_queues`` in
        tokens, ``read_rates`` in tokens per second."""
        waiting = WaitingRequest(
            request.request_id, request.num_prompt_tokens, hit_blocks * self.block_size
        )
        a = self.place(
            waiting,
            [prefill_load(v, in_prefill.get(v.instance_id, 0)) for v in prefills],
            [decode_load(v, self.block_size) for v in decodes],
            read_queues,
            conductor,
            read_rates,
        )
        decision = ConductorDecision(
            accepted=True,
            prefill_id=a.prefill,
            decode_id=a.decode,
            cached_blocks=hit_blocks,
            transfer_from=None,
            replicate_blocks=[],
            predicted_ttft=0.0,
            predicted_tbt=0.0,
            retry_after=None,
            reason="",
        )
        return decision, a
