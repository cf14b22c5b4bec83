"""Resource arithmetic shared by the node and placement-group plans.

Resources are Ray's: a mapping of names to amounts (``{"CPU": 2.0, "GPU": 1.0}``), in
floats because Ray allows fractional CPUs; comparisons allow a rounding slack of ``EPS``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

Resources = Mapping[str, float]

EPS = 1e-9


class PlacementError(ValueError):
    """A deployment does not fit the cluster; the message says what to change."""


def fits(resources: Resources, needs: Resources) -> bool:
    """Whether ``needs`` fit in ``resources``."""
    return all(resources.get(r, 0.0) + EPS >= v for r, v in needs.items() if v > 0)


def capacity(resources: Resources, bundle: Resources) -> int:
    """How many ``bundle``s fit in ``resources`` (0 for a bundle that reserves nothing)."""
    return min(
        (math.floor(resources.get(r, 0.0) / v + EPS) for r, v in bundle.items() if v > 0),
        default=0,
    )


def describe(resources: Resources) -> str:
    """``{CPU: 1, GPU: 2}``: the amounts above zero, for error messages."""
    return "{" + ", ".join(f"{r}: {v:g}" for r, v in sorted(resources.items()) if v > 0) + "}"
