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
from actors.serving.replica import ReplicaServer
from actors.serving.router import RankedRequestRouter, RouterDeployment


def _scaling_options(group: ReplicaGroupConfig) -> dict[str, Any]:
    """A fixed ``num_replicas``, or Serve's ``autoscaling_config`` with Meridian's policy
    (``policies.autoscaling``) and a drain: a replica Serve removes stops getting requests,
    finishes the ones it holds (Serve checks every ``graceful_shutdown_wait_loop_s``, for at
    most ``graceful_shutdown_timeout_s``), then leaves the router's view."""
    scaling = group.autoscaling
    if scaling is None:
        return {"num_replicas": group.num_replicas}
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
        logging_config=LoggingConfig(enable_access_log=False),  # replicas report ~10/s
    ).bind(cfg.routing, cfg.block_size, cfg.routing_options)
    replicas = {
        g.name: deployment(
            ReplicaServer,
            name=f"Replica-{g.name}",
            max_ongoing_requests=g.max_ongoing_requests,
            ray_actor_options=_actor_options(cfg, g),
            health_check_period_s=5,
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


app = build_app({})
