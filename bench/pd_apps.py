"""The Serve apps ``bench/pd_pools.py`` and ``bench/pd_pools_scale.py`` run: a two-node
local Ray cluster with one Serve application per config, started and torn down as one
context (``running_apps``), and the readers of what they answer (``/health``, ``/metrics``
samples)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.app_probe import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


def model_name(args: argparse.Namespace) -> str:
    return "meridian-tiny" if args.model == "tiny" else Path(args.model).stem


@contextlib.contextmanager
def running_apps(
    apps: dict[str, dict[str, Any]], args: argparse.Namespace
) -> Iterator[dict[str, str]]:
    """The two-node Ray cluster and one Serve application per entry of ``apps`` (name ->
    ``ServeConfig`` fields), route prefix ``/<name>``; yields each one's base URL once all
    answer ``/health`` with all their Serve replicas."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from actors.serving.config import ServeConfig

    configs = {name: ServeConfig.parse(fields) for name, fields in apps.items()}
    threads = str(args.torch_threads)
    env = {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "RAY_AUTH_MODE": "disabled",  # a private 127.0.0.1 cluster: no tokens
    }
    os.environ.update(env)  # the raylets, and every worker they start, inherit it
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.head_cpus,
            "include_dashboard": False,
            # Ray starts workers at nice 15: the engines run at the client's priority
            "_system_config": {"worker_niceness": 0},
        },
    )
    try:
        cluster.add_node(num_cpus=args.node_cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env})
        from serve_app import build_app

        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        # all deployed at once: their replicas load the model side by side
        targets = [
            serve.RunTarget(build_app(fields), name=name, route_prefix=f"/{name}")
            for name, fields in apps.items()
        ]
        serve.run_many(targets, wait_for_applications_running=False)
        urls = {name: f"http://127.0.0.1:{port}/{name}" for name in apps}
        for name in apps:  # side by side: the first wait covers most of the others'
            wait_healthy(urls[name], configs[name].groups[0].num_replicas, 900)
        yield urls
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()


SAMPLE_RE = re.compile(r"^([\w:]+)\{([^}]*)\} (\S+)$")
LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in a ``/metrics`` text."""
    out = []
    for line in text.splitlines():
        m = SAMPLE_RE.match(line)
        if m is not None and m[1] == name:
            out.append((dict(LABEL_RE.findall(m[2])), float(m[3])))
    return out
