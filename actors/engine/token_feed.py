"""A step's sampled tokens fed to the next step on the device (``overlap_steps``).

With ``StepPlan.keep_tokens`` a worker keeps the tokens a step samples on the device
(``step_plan.DeviceTokens``) and returns them unread: ``StepResult.read`` brings them to the
host when the controller asks for the result. By then the controller may have planned and
submitted the next step, whose decode entries carry ``PLACEHOLDER`` (the scheduler's
``advance``) for the token their request sampled in the previous step; the worker puts the
kept tokens in their place on the device (``feed``), so the next step never waits for the
host to see the values.

Invariant: a placeholder only stands for a token the worker's previous step sampled for
that request; a plan that feeds anything else is refused (ValueError), never guessed.
"""

from __future__ import annotations

import torch

from actors.engine.step_plan import DeviceTokens, PlanEntry
from policies.scheduler import PLACEHOLDER


def feed_sources(entries: list[PlanEntry], previous: DeviceTokens | None) -> list[int] | None:
    """Per input row (the entries' tokens, in order): the row of ``previous`` whose token
    it takes, or -1 for a token already known. None: no row is a placeholder."""
    sources: list[int] = []
    rows: dict[str, int] | None = None
    for e in entries:
        if PLACEHOLDER not in e.token_ids:
            sources.extend([-1] * e.num_tokens)
            continue
        if rows is None:
            if previous is None:
                raise ValueError(
                    f"request {e.request_id!r} is fed its previous token, but this worker "
                    "kept no tokens from a previous step"
                )
            rows = {r: i for i, r in enumerate(previous.request_ids)}
        row = rows.get(e.request_id)
        if row is None:
            raise ValueError(
                f"request {e.request_id!r} is fed its previous token, but the previous step "
                "did not sample one for it"
            )
        sources.extend(row if t == PLACEHOLDER else -1 for t in e.token_ids)
    return sources if rows is not None else None


def feed(input_ids: torch.Tensor, sources: list[int], previous: DeviceTokens) -> torch.Tensor:
    """``input_ids [T]`` with every row whose source is ``>= 0`` replaced by that row of
    ``previous.tokens`` (on ``input_ids``' device, without reading either back)."""
    src = torch.tensor(sources, dtype=torch.int64).to(input_ids.device, non_blocking=True)
    fed = previous.tokens.to(input_ids.device).index_select(0, src.clamp(min=0))
    return torch.where(src >= 0, fed, input_ids)
