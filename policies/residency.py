"""Per-tenant data residency: which regions may receive a tenant's traffic (SkyWalker 4.1).

A policy maps a tenant to the set of regions its requests may be served in; a tenant
without an entry may go anywhere (``default`` None), or only where ``default`` allows.
``allowed(tenant, region)`` is the filter a balancer applies before forwarding; the
tenant's own region is allowed only if the policy lists it (a request enters at its
client's region, and a policy that excludes it is refused at configuration time by the
caller, not silently routed).

Pure: stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class ResidencyPolicy:
    def __init__(
        self,
        tenants: Mapping[str, Iterable[str]] | None = None,
        default: Iterable[str] | None = None,
    ) -> None:
        self._tenants = {t: frozenset(r) for t, r in (tenants or {}).items()}
        for t, regions in self._tenants.items():
            if not regions:
                raise ValueError(f"tenant {t!r} allows no region; list at least one")
        self._default = frozenset(default) if default is not None else None

    def regions_for(self, tenant: str | None) -> frozenset[str] | None:
        """The regions ``tenant`` may use, or None for any region."""
        if tenant is not None and tenant in self._tenants:
            return self._tenants[tenant]
        return self._default

    def allowed(self, tenant: str | None, region: str) -> bool:
        regions = self.regions_for(tenant)
        return regions is None or region in regions

    def filter(self, tenant: str | None, regions: Iterable[str]) -> list[str]:
        """``regions`` that ``tenant`` may use, in the given order."""
        return [r for r in regions if self.allowed(tenant, r)]
