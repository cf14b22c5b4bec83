"""Ray and Serve in the bench's own process, the one way benches start either:
``local_ray`` (a new local cluster whose workers see ``env`` and run at nice 0),
``local_serve`` (that, plus Serve's proxy on a free port), ``deploy`` (one application
from ``serve_app.build_app``'s arguments, returned once ``/health`` counts its replicas)
and ``serve_app`` (all three as one context). Everything is stopped on the way out, the
KV store's shared-memory segments included.

Apps started as ``serve run`` in their own session (what a user types) are
``bench/serve_defaults.py``'s. ``nodes`` makes the cluster several local nodes, and
``deploy_many`` puts several applications on it at once (``bench/pd_apps.py``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.app_probe import free_port, wait_healthy

APP = "meridian"
DIRECT_MIN = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"  # Ray Serve's direct-ingress port range
DIRECT_MAX = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
DIRECT_SPAN = 51  # ports in that range: one per ingress replica on a node, with room


@dataclass(frozen=True)
class ServeHost:
    """Where a started Serve answers: ``url`` is the direct-ingress replica's own port when
    direct ingress is on (one ingress replica takes the first port of its range), else the
    proxy's."""

    url: str
    proxy_url: str


@contextlib.contextmanager
def local_ray(
    env: dict[str, str] | None = None, num_cpus: int | None = 4, nodes: Sequence[int] = ()
) -> Iterator[None]:
    """A new local Ray cluster (never one that ``ray start`` recorded on this machine),
    ``env`` set here and in every worker; Ray starts workers at nice 15, these run at 0, the
    priority of the bench client and of a peer server. ``num_cpus`` None: the machine's.
    ``nodes``: more local nodes, their CPUs each (Ray's ``cluster_utils.Cluster``, the
    first node the head with ``num_cpus``)."""
    import ray

    # the raylets inherit it, and their workers (no runtime environment: with one, Ray starts
    # every worker through its environment set-up)
    os.environ.update(env or {})
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = None
    if nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": num_cpus,
                "include_dashboard": False,
                "_system_config": {"worker_niceness": 0},
            },
        )
    try:
        if cluster is not None:
            for cpus in nodes:
                cluster.add_node(num_cpus=cpus)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
        else:
            ray.init(
                "local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                _system_config={"worker_niceness": 0},
            )
        yield
    finally:
        try:
            ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            with contextlib.suppress(Exception):
                from store.shared_segment import remove_stale_segments

                remove_stale_segments()


@contextlib.contextmanager
def local_serve(
    env: dict[str, str] | None = None,
    num_cpus: int = 4,
    direct: bool = False,
    nodes: Sequence[int] = (),
) -> Iterator[ServeHost]:
    """``local_ray`` and Serve's proxy on a free local port (on the head node alone when
    there are more ``nodes``: theirs would take the same port); with ``direct``, direct
    ingress on a free port range. Serve goes down with its cluster: a graceful
    ``serve.shutdown()`` first would only wait for replicas to drain (11-15 s)."""
    from ray import serve

    env = dict(env or {})
    direct_port = free_port(DIRECT_SPAN)
    if direct:
        env |= {
            "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            DIRECT_MIN: str(direct_port),
            DIRECT_MAX: str(direct_port + DIRECT_SPAN - 1),
        }
    with local_ray(env, num_cpus, nodes):
        port = free_port()
        http = {"host": "127.0.0.1", "port": port}
        if nodes:
            serve.start(proxy_location="HeadOnly", http_options=http)
        else:
            serve.start(http_options=http)
        proxy = f"http://127.0.0.1:{port}"
        yield ServeHost(f"http://127.0.0.1:{direct_port}" if direct else proxy, proxy)


def deploy(host: ServeHost, app_args: dict[str, Any], replicas: int, name: str = APP) -> str:
    """The application of ``app_args`` (``serve_app.build_app``'s) at ``/`` of ``host``,
    replacing one of the same name; its URL once ``/health`` counts ``replicas``."""
    from ray import serve

    from serve_app import build_app

    serve.run(build_app(app_args), name=name, route_prefix="/", blocking=False)
    wait_healthy(host.url, replicas)
    return host.url


def deploy_many(
    host: ServeHost, apps: dict[str, tuple[dict[str, Any], int]], timeout_s: float = 600.0
) -> dict[str, str]:
    """Every application of ``apps`` (name -> (``build_app``'s arguments, replicas)) at
    ``/<name>`` of ``host``, all deployed at once so their replicas load side by side; each
    one's URL once every ``/health`` counts its replicas."""
    from ray import serve

    from serve_app import build_app

    targets = [
        serve.RunTarget(build_app(args), name=name, route_prefix=f"/{name}")
        for name, (args, _) in apps.items()
    ]
    serve.run_many(targets, wait_for_applications_running=False)
    urls = {name: f"{host.url}/{name}" for name in apps}
    for name, (_, replicas) in apps.items():  # the first wait covers most of the others'
        wait_healthy(urls[name], replicas, timeout_s)
    return urls


@contextlib.contextmanager
def serve_app(
    app_args: dict[str, Any],
    replicas: int,
    env: dict[str, str] | None = None,
    num_cpus: int = 4,
    direct: bool = False,
) -> Iterator[str]:
    """``local_serve`` with one application deployed; yields its URL once healthy."""
    with local_serve(env, num_cpus, direct) as host:
        yield deploy(host, app_args, replicas)
