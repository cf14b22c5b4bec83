"""The one deployment config of the serving app: model, replica groups, routing, keys, limits.
A plain pydantic model, no filesystem access except ``from_yaml``: the same object travels
as Serve application ``args`` (``serve run`` / ``serve deploy``), a YAML file, or Python.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.disagg.dualpath_placement import SCHEDULERS
from actors.disagg.read_paths import READ_PATHS
from actors.engine.config import EngineConfig
from actors.engine.defaults import (
    DECODE_WAIT_MAX,
    DECODE_WAIT_S,
    PIN_CORES,
    STORE_MIN_LOAD_TOKENS,
    report_interval_for,
)
from actors.serving.engine_section import EngineSection
from actors.serving.pd_layout import PDLayoutConfig, check_pools, check_side_kv
from actors.serving.regions_section import RegionsSectionConfig
from actors.serving.store_section import check_colocated_store, check_pd_store
from policies.rate_limit import KeyRateLimits
from policies.shard_choice import check_placement

RoutingPolicyName = Literal[
    "round_robin", "least_loaded", "power_of_two", "prefix_aware", "consistent_hash"
]


class ConfigError(ValueError):
    """A deployment config that does not validate: one line per problem, each starting
    with where it is in the YAML (``groups[0].engine.tokn_budget: unknown key``)."""

    @classmethod
    def of(cls, error: ValidationError) -> ConfigError:
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        lines = []
        for e in error.errors():
            where = yaml_path(e["loc"])
            if e["type"] != "extra_forbidden":
                lines.append(f"{where}: {e['msg']}")
                continue
            hint = ""
            loc = e["loc"]  # a group-level key that is an engine option: say where it goes
            if len(loc) == 3 and loc[0] == "groups" and loc[2] in engine_fields:
                hint = f"; it is an engine option: put it under {yaml_path(loc[:2])}.engine"
            lines.append(f"{where}: unknown key{hint}")
        return cls("invalid config:\n  " + "\n  ".join(lines))


def yaml_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a path into the YAML: ``groups[0].engine.token_budget``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or "(top level)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in a config key is an error, not a no-op


class StoreSectionConfig(_Strict):
    """KV store shards of a disaggregated group (``actors.disagg.store_view.StoreConfig``), started
    by each Serve replica of the group. ``ssd_dir`` is a folder on the replica's node; each
    replica uses a subfolder of it named after its replica id. DualPath: ``read_path`` is
    where a stored prefix is read ("prefill", "decode" or "dual": per request, the side with
    the shorter read queue); ``write_back`` makes decode replicas write each block to the
    store as it fills, so a conversation's next turn hits its own previous answer.

    A colocated group's store (``actors.serving.store_engine``) is app-wide: ``num_shards``
    per Ray node, shared by every replica of the group; a replica loads a stored prefix only
    when it brings at least ``min_load_tokens`` tokens (fewer compute faster). Which fields
    each kind of group may set: ``actors.serving.store_section``."""

    dram_bytes: int = Field(64 << 20, ge=1)
    ssd_bytes: int = Field(0, ge=0)
    ssd_dir: str | None = None
    num_shards: int = Field(1, ge=1)
    read_path: str = "prefill"
    write_back: StrictBool = False
    # sessions: the share of a shard's blocks (DRAM + SSD) one tenant's retained blocks may
    # hold; past it that tenant's oldest retained blocks lose retention first
    tenant_retained_share: float = Field(0.5, gt=0, le=1)
    min_load_tokens: int = Field(STORE_MIN_LOAD_TOKENS, ge=0)  # colocated groups only
    # which shard a prefix is written to (policies.shard_choice): "key", its first block's
    # owner, so a conversation's blocks share one shard and prefixes spread over all; or
    # "local", the writer's node. null: "local" in a disaggregated group (measured faster:
    # docs/benchmarks.md, bench/pd_pools.py), "key" in a colocated one
    placement: str | None = None

    @field_validator("placement")
    @classmethod
    def _known_placement(cls, value: str | None) -> str | None:
        return None if value is None else check_placement(value)

    def placement_for(self, disaggregated: bool) -> str:
        """The placement this group's store uses (``placement``, or its kind's default)."""
        if self.placement is not None:
            return self.placement
        return "local" if disaggregated else "key"

    @field_validator("read_path")
    @classmethod
    def _known_read_path(cls, value: str) -> str:
        if value not in READ_PATHS:
            raise ValueError(
                f"store.read_path must be one of {', '.join(READ_PATHS)}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> StoreSectionConfig:
        if self.ssd_bytes > 0 and not self.ssd_dir:
            raise ValueError("store.ssd_bytes > 0 needs store.ssd_dir (a folder for the SSD tier)")
        return self


class ConductorSectionConfig(_Strict):
    """A disaggregated group's Conductor (``policies.conductor``): SLOs in seconds (TTFT,
    time between tokens), admission ("predictive": reject when the predicted TTFT, or the
    TBT expected when it reaches decode, misses its SLO; "early": judge decode load at
    arrival; "none": only when no decode replica has room), hot-block replication
    threshold, refitted estimates, and how long / how many wait for decode room before a
    429 (``policies.decode_wait``)."""

    ttft_slo: float = Field(60.0, gt=0)
    tbt_slo: float = Field(10.0, gt=0)
    admission: Literal["none", "early", "predictive"] = "predictive"
    replication_threshold: float = Field(2.0, ge=1)
    fit_costs: bool = True
    decode_wait_s: float = Field(DECODE_WAIT_S, ge=0)
    decode_wait_max: int = Field(DECODE_WAIT_MAX, ge=0)
    scheduler: str = "mooncake"  # "dualpath": DualPath's rules place requests instead

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        if value not in SCHEDULERS:
            raise ValueError(
                f"conductor.scheduler must be one of {', '.join(SCHEDULERS)}, got {value!r}"
            )
        return value


class AdmissionSectionConfig(_Strict):
    """SLO-aware admission of a colocated group (``policies.admission.ColocatedAdmission``):
    each replica predicts a new request's TTFT from its queued prefill work and decodes
    (a step-cost model fitted from its measured steps) and refuses it with 429 and
    Retry-After when that misses ``ttft_slo`` seconds. Without this section a replica
    admits by queue length only (``limits.max_waiting_per_replica``)."""

    ttft_slo: float = Field(gt=0)


class AutoscalingSectionConfig(_Strict):
    """Autoscaling of a colocated group: Serve's ``autoscaling_config`` (the group then sets
    no ``num_replicas``) with Meridian's policy (``policies.autoscaling``): the group's need
    is the largest of its queued prefill tokens / ``target_queued_prefill_tokens``, its
    summed KV usage / ``target_kv_usage`` and, if set, its running + waiting requests /
    ``target_requests``; it shrinks only to where that load would be at most
    ``downscale_threshold`` of the targets. A wish must hold ``upscale_delay_s`` /
    ``downscale_delay_s`` before Serve acts on it; replicas report their load every
    ``metrics_interval_s`` and Serve averages it over ``look_back_period_s``. A replica
    being removed first finishes what it holds, for at most ``drain_timeout_s``."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    initial_replicas: int | None = Field(None, ge=1)  # None: min_replicas
    target_queued_prefill_tokens: int = Field(2048, ge=1)
    target_kv_usage: float = Field(0.8, gt=0, le=1)
    target_requests: float | None = Field(None, gt=0)
    downscale_threshold: float = Field(0.7, gt=0, le=1)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(300.0, ge=0)
    look_back_period_s: float = Field(10.0, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSectionConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscaling.max_replicas ({self.max_replicas}) must be >= "
                f"autoscaling.min_replicas ({self.min_replicas})"
            )
        start = self.start_replicas
        if not self.min_replicas <= start <= self.max_replicas:
            raise ValueError(
                f"autoscaling.initial_replicas ({start}) must be between "
                f"autoscaling.min_replicas ({self.min_replicas}) and "
                f"autoscaling.max_replicas ({self.max_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"autoscaling.look_back_period_s ({self.look_back_period_s}) must be more "
                f"than autoscaling.metrics_interval_s ({self.metrics_interval_s})"
            )
        return self

    @property
    def start_replicas(self) -> int:
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas

    def policy_kwargs(self) -> dict[str, Any]:
        """``policies.autoscaling.ScalingTargets`` fields (JSON, as Serve wants them)."""
        return {
            "queued_prefill_tokens": self.target_queued_prefill_tokens,
            "kv_usage": self.target_kv_usage,
            "requests": self.target_requests,
            "downscale_threshold": self.downscale_threshold,
        }

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` of the group's deployment."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.start_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,  # the replicas' push period
            "policy": {
                "policy_function": "policies.autoscaling:LLMAutoscalingPolicy",
                "policy_kwargs": self.policy_kwargs(),
            },
        }


class ReplicaGroupConfig(_Strict):
    """``num_replicas`` replicas that share one engine config.

    ``engine`` is the replicas' ``EngineConfig`` (actors/engine/config.py), written as a
    mapping of its fields: the parallel degrees ``tp`` / ``spp`` / ``kvp``, the MoE layout
    (``attention_workers``, ``expert_workers``, ``micro_batches``), block_size, num_blocks,
    kv_cache_memory, token_budget, max_num_seqs, chunk_size, max_model_len, ...; an unknown
    one is an error naming its path. It is validated once, here; everything downstream
    takes the ``EngineConfig`` object.

    Disaggregated group: ``num_prefill`` and ``num_decode`` (both, or neither) make each
    Serve replica of the group own one ``PDCluster`` of that many prefill and decode replica
    actors (``engine`` applies to each of them; their layouts are ``prefill`` and
    ``decode``, tp x spp each), placed by the Conductor (set by ``conductor``), with the KV
    store shards of ``store`` if given (the cluster's ``PDClusterConfig`` is built from these
    sections by ``actors.serving.pd_group``). ``num_replicas`` then counts such clusters and
    defaults to 1 (colocated groups default to 2). A colocated group's ``store`` is one set
    of shards all its replicas share (``actors.serving.store_engine``).
    """

    name: str = "default"
    num_replicas: int = Field(2, ge=1)
    # warm spares beyond num_replicas, loaded but not routed to; one takes a replica's place
    # as soon as Serve finds it dead (policies/standby.py). Colocated, fixed-size groups
    standby_replicas: int = Field(0, ge=0)
    num_cpus: float = Field(0.0, ge=0)  # Ray CPUs reserved per replica actor
    max_ongoing_requests: int = Field(256, ge=1)  # Serve's per-replica concurrency cap
    engine: EngineSection = Field(default_factory=EngineConfig)
    num_prefill: int | None = Field(None, ge=1)
    num_decode: int | None = Field(None, ge=1)
    store: StoreSectionConfig | None = None
    conductor: ConductorSectionConfig | None = None
    admission: AdmissionSectionConfig | None = None  # colocated groups (P/D: conductor)
    autoscaling: AutoscalingSectionConfig | None = None  # colocated groups; sets the count
    prefill: PDLayoutConfig | None = None
    decode: PDLayoutConfig | None = None
    # on one node, replicas (P/D: prefill and decode sides) take disjoint cores
    # (actors/engine/defaults.py); false leaves the engine threads to the OS
    pin_cores: StrictBool = PIN_CORES

    @model_validator(mode="before")
    @classmethod
    def _default_replicas(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_replicas" not in data:
            pd = data.get("num_prefill") is not None or data.get("num_decode") is not None
            data = {**data, "num_replicas": 1 if pd else 2}
            scaling = data.get("autoscaling")
            if isinstance(scaling, dict):  # it starts with its initial (or min) replicas
                start = scaling.get("initial_replicas") or scaling.get("min_replicas", 1)
                if isinstance(start, int) and start >= 1:
                    data["num_replicas"] = start
        return data

    @model_validator(mode="after")
    def _check(self) -> ReplicaGroupConfig:
        where = f"group {self.name!r}"
        if (self.num_prefill is None) != (self.num_decode is None):
            raise ValueError(
                f"{where}: give both num_prefill and num_decode (a disaggregated group) "
                "or neither (colocated replicas)"
            )
        if self.standby_replicas and (self.autoscaling is not None or self.disaggregated):
            kind = "an autoscaled" if self.autoscaling is not None else "a disaggregated"
            raise ValueError(
                f"{where}: standby_replicas is for colocated groups of a fixed num_replicas, "
                f"not {kind} group; remove standby_replicas"
            )
        if self.autoscaling is not None:
            if self.disaggregated:
                raise ValueError(
                    f"{where}: autoscaling is for colocated groups; remove autoscaling or "
                    "num_prefill and num_decode"
                )
            if self.num_replicas != self.autoscaling.start_replicas:
                raise ValueError(
                    f"{where}: num_replicas ({self.num_replicas}) conflicts with autoscaling "
                    f"(which starts {self.autoscaling.start_replicas}); remove num_replicas "
                    "and set autoscaling.initial_replicas"
                )
        if not self.disaggregated:
            for section in ("conductor", "prefill", "decode"):
                if getattr(self, section) is not None:
                    raise ValueError(
                        f"{where}: {section} needs num_prefill and num_decode (only "
                        f"disaggregated groups have one); remove {section} or add both"
                    )
            if self.store is not None:
                check_colocated_store(where, self.store, self.engine, StoreSectionConfig())
            return self
        if self.store is not None:
            check_pd_store(where, self.store, StoreSectionConfig())
        if self.engine.attention_workers:
            raise ValueError(
                f"{where}: attention/expert workers are a layout of colocated replicas; "
                "remove engine.attention_workers/expert_workers or num_prefill and num_decode"
            )
        if self.admission is not None:
            raise ValueError(
                f"{where}: a disaggregated group admits through its conductor section "
                "(ttft_slo, tbt_slo, admission); remove admission"
            )
        if self.engine.cpu_cores is not None:
            raise ValueError(
                f"{where}: engine.cpu_cores pins a colocated replica's engine thread; "
                "prefill and decode replicas do not take it yet: remove cpu_cores"
            )
        for name in ("tp", "spp", "kvp"):
            degree = getattr(self.engine, name)
            if degree != 1:
                raise ValueError(
                    f"{where}: a disaggregated group sets its replicas' layouts in its "
                    f"prefill and decode sections (tp, spp); remove engine.{name}={degree}"
                )
        if self.prefill is not None and self.prefill.kvp > 1:
            raise ValueError(
                f"{where}: a prefill replica streams each request from one KV rank; remove "
                f"prefill.kvp={self.prefill.kvp} (decode replicas may be KV-parallel)"
            )
        check_side_kv(where, self.engine, self.prefill, self.decode)
        assert self.num_prefill is not None and self.num_decode is not None
        sides = {
            "prefill": (self.num_prefill, self.prefill),
            "decode": (self.num_decode, self.decode),
        }
        check_pools(where, self.num_replicas, sides)
        store, decode = self.store, self.decode
        if store is not None and decode is not None and decode.tp * decode.spp * decode.kvp > 1:
            # both use a decode replica's cache in its own process
            uses = ["store.write_back"] if store.write_back else []
            uses += [f"store.read_path {store.read_path}"] if store.read_path != "prefill" else []
            if uses:
                verb = "needs" if len(uses) == 1 else "need"
                raise ValueError(
                    f"{where}: {' and '.join(uses)} {verb} single-worker decode replicas; "
                    "remove them or set decode tp = spp = kvp = 1"
                )
        if self.store is not None and self.prefill is not None and self.prefill.tp > 1:
            # the store reads and writes a prefill replica's whole layers: one worker, or
            # pipeline stages (CPP, spp > 1) whose caches the replica maps
            raise ValueError(
                f"{where}: the KV store needs prefill replicas of tp = 1 (spp, chunked "
                "pipeline parallelism, may be more); remove store or set prefill tp = 1"
            )
        return self

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill is not None


class ApiKeyConfig(_Strict):
    """One API key. Requests with it run as ``tenant``: its prefix cache is salted with the
    tenant name, so no other tenant's prompts can hit it.

    Rate limits (``policies.rate_limit``, token buckets holding one minute's allowance) are
    kept by each ingress replica on its own: with ``ingress_replicas`` > 1 a key may get up
    to that many times its limits in all. ``tokens_per_minute`` counts ``usage.total_tokens``:
    a request reserves prompt + n x max_tokens when admitted and gives back what it did not
    use when it ends; a request whose reservation alone is over the limit gets 400.
    """

    key: str = Field(min_length=8)
    tenant: str = Field(min_length=1)
    max_concurrent_requests: int | None = Field(None, ge=1)  # in flight at once; else 429
    requests_per_minute: int | None = Field(None, ge=1)  # else 429 with Retry-After
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion; else 429
    role: Literal["user", "admin"] = "user"  # admin: may also call /admin/* (admin.py)

    def rate_limits(self) -> KeyRateLimits:
        return KeyRateLimits(self.requests_per_minute, self.tokens_per_minute)


class SessionsConfig(_Strict):
    """KV retention of sessions (``store.retention``): a request's ``kv_retention_s`` (else
    its tenant's entry in ``tenant_kv_retention_s``, else ``default_kv_retention_s``) is how
    long the KV store keeps the turn's blocks ahead of LRU eviction after the turn ends.
    A request asking for more than ``max_kv_retention_s`` gets 400 naming the field.

    Only a disaggregated group's KV store (its ``store`` section) retains blocks, and the
    router may send a request to any group, so retention is refused, never ignored, unless
    every group has a store (``ServeConfig.storeless_group``): a nonzero default or tenant entry
    is a ``ConfigError`` naming it, and a request asking for more than 0 gets 400 naming
    ``kv_retention_s`` (``ServeConfig.session_retention_s``)."""

    default_kv_retention_s: float = Field(0.0, ge=0)
    max_kv_retention_s: float = Field(600.0, ge=0)
    tenant_kv_retention_s: dict[str, float] = Field(default_factory=dict)  # tenant -> default

    @model_validator(mode="after")
    def _check(self) -> SessionsConfig:
        for name, value in self.defaults().items():
            if not 0 <= value <= self.max_kv_retention_s:
                raise ValueError(
                    f"sessions.{name} must be in [0, max_kv_retention_s = "
                    f"{self.max_kv_retention_s}], got {value}"
                )
        return self

    def defaults(self) -> dict[str, float]:
        """The default retentions, each by its key under ``sessions``."""
        tenants = self.tenant_kv_retention_s.items()
        named = {f"tenant_kv_retention_s[{t!r}]": v for t, v in tenants}
        return {"default_kv_retention_s": self.default_kv_retention_s} | named

    def retention_s(self, asked: float | None, tenant: str | None) -> float:
        """The retention a request gets; ValueError (a 400 on ``kv_retention_s``) above
        the bound."""
        if asked is None:
            return self.tenant_kv_retention_s.get(tenant or "", self.default_kv_retention_s)
        if asked > self.max_kv_retention_s:
            raise ValueError(
                f"kv_retention_s must be at most {self.max_kv_retention_s} seconds, got {asked}"
            )
        return asked


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(1 << 20, ge=1024)  # larger bodies get 413
    max_tokens: int = Field(1024, ge=1)  # upper bound a request may ask for
    default_max_tokens: int = Field(16, ge=1)
    max_n: int = Field(8, ge=1)  # choices per request
    max_pending_requests: int = Field(512, ge=1)  # in flight per ingress replica; else 429
    max_waiting_per_replica: int = Field(256, ge=1)  # a replica's queue; else 429
    retry_after_s: int = Field(1, ge=1)  # the Retry-After header of a 429


class ServeConfig(_Strict):
    model: str | None = None  # a Hugging Face model folder; None: the built-in tiny model
    model_name: str = "meridian-tiny"  # the id clients send as ``model``
    groups: list[ReplicaGroupConfig] = Field(default_factory=lambda: [ReplicaGroupConfig()])
    routing: RoutingPolicyName = "prefix_aware"
    routing_options: dict[str, Any] = Field(default_factory=dict)  # passed to the policy
    # The request header whose value is a request's session key (what ``consistent_hash``,
    # SkyWalker-CH, hashes; ``prefix_aware`` breaks ties by it) when its body has no
    # ``session_id``; without either, its ``user`` field is the key.
    session_header: str = Field("x-session-id", min_length=1, pattern=r"^[A-Za-z0-9-]+$")
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)  # empty: no auth
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    # replica -> router event/stat pushes while busy; None: ``report_interval()``
    report_interval_s: float | None = Field(None, gt=0)
    ingress_replicas: int = Field(1, ge=1)
    regions: RegionsSectionConfig | None = None  # None: one global router
    # how chat answers spell tool calls (actors/serving/tool_parsers.py); None: detected
    # from the model's chat template
    tool_parser: Literal["hermes", "llama3_json"] | None = None
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)

    def report_interval(self) -> float:
        """``report_interval_s``, else this config's default (``actors/engine/defaults.py``)."""
        explicit = self.report_interval_s
        return explicit if explicit is not None else report_interval_for(self.regions is not None)

    def storeless_group(self) -> str | None:
        """A group without a KV store to retain sessions' KV in (None: every group has one).
        The router ranks the replicas of every group, so the ingress cannot know a
        request's group before routing it: retention needs a store in each (colocated or
        disaggregated)."""
        return next((g.name for g in self.groups if g.store is None), None)

    def session_retention_s(self, asked: float | None, tenant: str | None) -> float:
        """The ``kv_retention_s`` a request gets (``SessionsConfig.retention_s``); ValueError
        (a 400 on ``kv_retention_s``) above the bound, or above 0 with a storeless group."""
        retention = self.sessions.retention_s(asked, tenant)
        bare = self.storeless_group()
        if retention > 0 and bare is not None:
            raise ValueError(
                f"kv_retention_s needs a KV store to keep the turn in, and group {bare!r} "
                "of this server has none; leave kv_retention_s out or send 0 (the server "
                "retains KV only when every group has a store section)"
            )
        return retention

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        names = [g.name for g in self.groups]
        if not names or len(set(names)) != len(names):
            raise ValueError("groups must be non-empty with distinct names")
        if self.regions is not None:
            placed = [g for r in self.regions.regions for g in r.groups]
            if sorted(placed) != sorted(names):
                raise ValueError(
                    f"every group must be in exactly one region: groups {sorted(names)}, "
                    f"listed in regions {sorted(placed)}"
                )
        keys = [k.key for k in self.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("api_keys must be distinct")
        if len({g.engine.block_size for g in self.groups}) != 1:
            raise ValueError("every group needs the same engine.block_size (one hash chain)")
        if self.limits.default_max_tokens > self.limits.max_tokens:
            raise ValueError("limits.default_max_tokens must be <= limits.max_tokens")
        bare = self.storeless_group()
        kept = [(name, v) for name, v in self.sessions.defaults().items() if v > 0]
        if kept and bare is not None:
            name, value = kept[0]
            raise ValueError(
                f"sessions.{name} = {value} retains KV in a group's KV store, and group "
                f"{bare!r} has none; give every group a store section, or set "
                f"sessions.{name} to 0"
            )
        return self

    @property
    def block_size(self) -> int:
        return self.groups[0].engine.block_size

    @property
    def num_replicas(self) -> int:
        return sum(g.num_replicas for g in self.groups)

    def group_engine_config(self, group: ReplicaGroupConfig) -> EngineConfig:
        """``group``'s engine config; in a region pinned to nodes, its worker actors also
        reserve the region's node resource (added to any ``engine.worker_resources``)."""
        config = group.engine
        pin = self.regions.group_resources(group.name) if self.regions is not None else {}
        if not pin:
            return config
        return dataclasses.replace(
            config, worker_resources={**(config.worker_resources or {}), **pin}
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        import yaml

        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        return cls.parse(raw)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServeConfig:
        """Serve application args: either the fields themselves or ``{"config": path}``."""
        args = dict(args or {})
        path = args.pop("config", None)
        if path is None:
            return cls.parse(args)
        base = cls.from_yaml(path).model_dump()
        base.update(args)  # fields given next to ``config`` override the file's
        return cls.parse(base)

    @classmethod
    def parse(cls, raw: Any) -> ServeConfig:
        """``model_validate``, raising ``ConfigError`` (each problem with its YAML path)."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ConfigError.of(e) from None
