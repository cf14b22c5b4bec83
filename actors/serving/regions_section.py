"""The Serve config's ``regions`` section (SkyWalker): the regions, their replica groups
and node resources, and how their balancers push, forward and choose."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REGION_RESOURCE_SHARE = 0.01  # of a region's node resource, per pinned actor


class RegionConfig(BaseModel):
    """One region: the replica groups in it. It gets its own balancer (SkyWalker).

    ``node_resource``: a custom Ray resource that only this region's nodes carry (e.g.
    ``ray start --resources='{"region-us": 100}'``); the region's Serve replicas, its
    balancer and the worker actors of its ``tp``/``spp``/``kvp`` > 1 and MoE replicas
    (``ServeConfig.group_engine_config``) each ask ``REGION_RESOURCE_SHARE`` of it, so Ray
    places them on those nodes. (The prefill/decode actors of a disaggregated group are
    placed by its own planner and are not pinned by it.) None: anywhere."""

    model_config = ConfigDict(extra="forbid")  # a typo in a config key is an error

    name: str = Field(min_length=1)
    groups: list[str] = Field(min_length=1)
    node_resource: str | None = Field(None, min_length=1)


class RegionsSectionConfig(BaseModel):
    """Regions, each with its own balancer (``actors.regions.serve_balancer``) running
    ``policies.region_balancer``: a FCFS queue, ``push`` ("selective": only to a replica with
    no waiting request; "cap": below ``outstanding_cap``; "immediate": at once), local
    replicas first, else (``forward``) the peer balancer with free replicas, a queue of at
    most ``remote_max_queue`` and the best prefix match. Replicas are probed every
    ``probe_interval_s``. ``delay_ms["a/b"]``: injected one-way delay between regions a and b
    (on one machine; missing pairs are 0). ``residency``: tenant -> the regions its requests
    may be served in. ``local_view``: how a balancer finds the local replica holding a
    prompt's prefix: "trie" (what it sent where, SkyWalker's) or "index" (the router's exact
    index of the replicas' cached blocks, one extra call per prompt). A client names its
    region with the ``X-Meridian-Region`` header (default: the first region)."""

    model_config = ConfigDict(extra="forbid")

    regions: list[RegionConfig] = Field(min_length=1)
    delay_ms: dict[str, float] = Field(default_factory=dict)
    probe_interval_s: float = Field(0.1, gt=0)
    push: Literal["selective", "immediate", "cap"] = "selective"
    outstanding_cap: int = Field(4, ge=1)
    remote_max_queue: int = Field(2, ge=0)
    forward: bool = True
    residency: dict[str, list[str]] = Field(default_factory=dict)
    local_view: Literal["trie", "index"] = "trie"
    # how a balancer picks among available targets (replicas, peer balancers): "trie"
    # (SkyWalker: the longest recorded prefix) or "hash" (SkyWalker-CH: the first available
    # one on a ring hash of the request's session key, ``ServeConfig.session_header``)
    choice: Literal["trie", "hash"] = "trie"

    @model_validator(mode="after")
    def _check(self) -> RegionsSectionConfig:
        if self.choice == "hash" and self.local_view == "index":
            raise ValueError("regions.choice 'hash' picks replicas by key: local_view must be trie")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError("regions.regions must have distinct names")
        for key, ms in self.delay_ms.items():
            pair = key.split("/")
            if len(pair) != 2 or not set(pair) <= set(names) or pair[0] == pair[1]:
                raise ValueError(
                    f"regions.delay_ms key {key!r} must be 'a/b' with two regions of {names}"
                )
            if ms < 0:
                raise ValueError(f"regions.delay_ms[{key!r}] must be >= 0")
        for tenant, allowed in self.residency.items():
            unknown = set(allowed) - set(names)
            if not allowed or unknown:
                raise ValueError(
                    f"regions.residency[{tenant!r}] must list known regions ({names}); "
                    f"bad: {sorted(unknown) or 'empty'}"
                )
        return self

    def region_of_group(self, group: str) -> RegionConfig | None:
        return next((r for r in self.regions if group in r.groups), None)

    def actor_resources(self, region: RegionConfig | None) -> dict[str, float]:
        """Ray ``resources`` that pin an actor to ``region``'s nodes (empty: unpinned)."""
        if region is None or region.node_resource is None:
            return {}
        return {region.node_resource: REGION_RESOURCE_SHARE}

    def group_resources(self, group: str) -> dict[str, float]:
        """Ray ``resources`` that pin the actors of ``group`` to its region's nodes."""
        return self.actor_resources(self.region_of_group(group))

    def delays(self) -> dict[tuple[str, str], float]:
        """Every pair of distinct regions -> one-way delay in seconds."""
        names = [r.name for r in self.regions]
        return {(a, b): self.delay_s(a, b) for a in names for b in names if a != b}

    def delay_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        ms = self.delay_ms.get(f"{a}/{b}", self.delay_ms.get(f"{b}/{a}", 0.0))
        return ms / 1000.0
