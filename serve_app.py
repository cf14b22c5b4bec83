"""The Ray Serve application: ``serve run serve_app:app`` starts the demo on localhost:8000.

Three deployments, built from one ``ServeConfig`` (actors/serving/config.py):

- ``Ingress``: the OpenAI-compatible FastAPI app (actors/serving/ingress.py);
- ``Router``: the global cache-aware router holding ``RouterState`` (actors/serving/router.py);
- ``Replica-<group>``: one deployment per replica group, each replica a ``ReplicaController``
  in an engine thread (actors/serving/replica.py), routed by ``RankedRequestRouter``; in a
  group with ``num_prefill`` / ``num_decode``, each replica owns a ``PDCluster`` of prefill
  and decode replica actors instead, and the Conductor's rejections become 429s. A group
  with an ``autoscaling`` section gets Serve's ``autoscaling_config`` instead of
  ``num_replicas``, scaled by ``policies.autoscaling.LLMAutoscalingPolicy`` on the load its
  replicas report (queued prefill tokens, KV usage).
- ``Balancer-<region>``: with a ``regions`` section, one SkyWalker balancer per region
  (actors/regions/serve_balancer.py): the ingress asks the client's region balancer
  (``X-Meridian-Region`` header) where to send each prompt instead of the router.

``build_region_ingress`` gives a region its own ingress: an application of its own (its own
route prefix, its ingress on the region's nodes) whose clients are placed by their region's
balancer, which forwards to peer balancers (docs/regions.md).

``app`` is the demo (the built-in tiny model, defaults). For anything else use the builder:
``serve run serve_app:build_app config=my.yaml`` or a Serve config file whose application
has ``import_path: serve_app:build_app`` and our fields under ``args`` (serve_config.yaml).
"""

from __future__ import annotations

from typing import Any, cast

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.schema import LoggingConfig

from actors.regions.serve_balancer import RegionBalancerDeployment, balancer_name
from actors.serving.config import ReplicaGroupConfig, ServeConfig
from actors.serving.ingress import Ingress
from actors.serving.region_entry import NamedHandle
from actors.serving.replica import ReplicaServer
from actors.serving.router import RankedRequestRouter, RouterDeployment

# Serve's controller finds a dead replica (router, ingress, engine replica) at its next
# health check: this period bounds how long a killed actor goes unnoticed (Serve's default
# is 10 s). Each check is one actor call of a few microseconds' work.
HEALTH_CHECK_PERIOD_S = 1.0


def _scaling_options(group: ReplicaGroupConfig) -> dict[str, Any]:
    """A fixed ``num_replicas``, or Serve's ``autoscaling_config`` with Meridian's policy
    (``policies.autoscaling``) and a drain: a replica Serve removes stops getting requests,
    finishes the ones it holds (Serve checks every ``graceful_shutdown_wait_loop_s``, for at
    most ``graceful_shutdown_timeout_s``), then leaves the router's view."""
    scaling = group.autoscaling
    if scaling is None:
        return {"num_replicas": group.num_replicas + group.standby_replicas}
    return {
        "autoscaling_config": scaling.serve_config(),
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": scaling.drain_timeout_s,
    }


def _actor_options(cfg: ServeConfig, group: ReplicaGroupConfig) -> dict[str, Any]:
    """A group's replica actor options: its CPUs, and its region's node resource if the
    config pins regions to nodes."""
    options: dict[str, Any] = {"num_cpus": group.num_cpus}
    if cfg.regions is not None:
        resources = cfg.regions.actor_resources(cfg.regions.region_of_group(group.name))
        if resources:
            options["resources"] = resources
    return options


def _region_resources(cfg: ServeConfig, region: str) -> dict[str, float]:
    if cfg.regions is None:
        return {}
    (r,) = [x for x in cfg.regions.regions if x.name == region]
    return cfg.regions.actor_resources(r)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """A Serve application from ``ServeConfig`` fields, or ``{"config": "file.yaml"}``."""
    cfg = ServeConfig.from_args(args)  # deployments take this object as validated
    deployment: Any = serve.deployment  # its stubs lose the Deployment type's bind()
    router = deployment(
        RouterDeployment,
        name="Router",
        num_replicas=1,
        max_ongoing_requests=100_000,  # each call is microseconds of pure Python
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        logging_config=LoggingConfig(enable_access_log=False),  # replicas report ~10/s
    ).bind(
        cfg.routing,
        cfg.block_size,
        cfg.routing_options,
        cfg.model,
        {g.name: g.num_replicas for g in cfg.groups if g.standby_replicas},
    )
    replicas = {
        g.name: deployment(
            ReplicaServer,
            name=f"Replica-{g.name}",
            max_ongoing_requests=g.max_ongoing_requests,
            ray_actor_options=_actor_options(cfg, g),
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            request_router_config=RequestRouterConfig(
                request_router_class=cast(Any, RankedRequestRouter)  # stubs want a dict
            ),
            **_scaling_options(g),
        ).bind(cfg, g.name, router)
        for g in cfg.groups
    }
    ingress = deployment(
        Ingress,
        name="Ingress",
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=cfg.limits.max_pending_requests + 64,
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    balancers: dict[str, Any] = {}  # region -> its balancer, with a regions section
    sec = cfg.regions
    for r in sec.regions if sec is not None else []:
        balancers[r.name] = deployment(
            RegionBalancerDeployment,
            name=balancer_name(r.name),
            num_replicas=1,
            max_ongoing_requests=100_000,  # requests wait in its queue, not Serve's
            ray_actor_options={"num_cpus": 0, "resources": _region_resources(cfg, r.name)},
            logging_config=LoggingConfig(enable_access_log=False),
        ).bind(cfg, r.name, router)
    return ingress.bind(cfg, router, replicas, balancers)


def build_region_ingress(args: dict[str, Any]) -> serve.Application:
    """Region ``args["region"]``'s own ingress, beside the main application (named
    ``args["app"]``, default ``"default"``) built from the same config (the other args): the
    OpenAI routes under this application's route prefix, each prompt placed by this region's
    balancer first (an ``X-Meridian-Region`` header may still name another region)."""
    args = dict(args)
    region = str(args.pop("region", ""))
    main = str(args.pop("app", "default"))
    cfg = ServeConfig.from_args(args)
    names = [r.name for r in cfg.regions.regions] if cfg.regions is not None else []
    if region not in names:
        raise ValueError(f"region must be one of the config's regions {names}, not {region!r}")
    order = [region, *(r for r in names if r != region)]  # the first is the default region
    deployment: Any = serve.deployment
    ingress = deployment(
        Ingress,
        name=f"Ingress-{region}",
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=cfg.limits.max_pending_requests + 64,
        ray_actor_options={"num_cpus": 0, "resources": _region_resources(cfg, region)},
    )
    return ingress.bind(
        cfg,
        NamedHandle("Router", main),
        {g.name: NamedHandle(f"Replica-{g.name}", main) for g in cfg.groups},
        {r: NamedHandle(balancer_name(r), main) for r in order},
    )


app = build_app({})
