"""What a disaggregated deployment's Conductor starts with, and how it says no.

``default_conductor`` builds Mooncake's Conductor (``policies.conductor``) with CPU-scale
starting estimates (the deployment refits them from measured steps, ``CostFitter``) and the
given SLOs and admission mode. ``RequestRejected`` is its refusal: HTTP 429 with
Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass

from errors import OverloadedError
from policies.conductor import Conductor
from policies.pd_costs import LinearDecodeTBT, LinearPrefillTime, transfer_time_fn


class RequestRejected(OverloadedError):
    """The deployment cannot meet its latency objectives for this request now; retry after
    ``retry_after`` seconds (HTTP 429 with Retry-After). ``reason``: the Conductor's."""

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(
            f"overloaded ({reason}): the deployment cannot serve this request within its "
            f"latency objectives now; retry after {retry_after:.1f} s",
            retry_after,
        )
        self.reason = reason


@dataclass(frozen=True)
class ConductorOptions:
    """The Conductor's SLOs in seconds (TTFT, time between tokens), its admission mode
    ("predictive", the default: reject when the predicted TTFT, or the TBT of the decode
    load expected when the request would reach decode, misses its SLO; "early": judge
    decode load at arrival; "none": reject only when no decode replica has room) and its
    hot-block replication threshold."""

    admission: str = "predictive"
    ttft_slo: float = 60.0
    tbt_slo: float = 10.0
    replication_threshold: float = 2.0


def default_conductor(block_bytes: int, options: ConductorOptions | None = None) -> Conductor:
    """CPU-scale starting estimates (refitted from measured steps unless ``fit_costs`` is
    off) and generous SLOs unless given; ``admission`` "predictive" (default) or "early"
    rejects by the SLOs (429), "none" only when decode has no room. Decode is priced by the
    fitted TBT model (each running request's remaining tokens at the predicted TBT), never
    by a fixed decode length."""
    o = options or ConductorOptions()
    return Conductor(
        prefill_time=LinearPrefillTime(base=2e-3, per_new_token=2e-4, per_cached_token=1e-6),
        decode_tbt=LinearDecodeTBT(base=5e-3, per_request=1e-4, per_block=1e-6),
        transfer_time=transfer_time_fn(block_bytes, bytes_per_second=4e9),
        ttft_slo=o.ttft_slo,
        tbt_slo=o.tbt_slo,
        replication_threshold=o.replication_threshold,
        admission=o.admission,
    )
