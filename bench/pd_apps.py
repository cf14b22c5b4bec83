"""The Serve apps ``bench/pd_pools.py`` and ``bench/pd_pools_scale.py`` run: a two-node
local Ray cluster with one Serve application per config, started and torn down as one
context (``running_apps``), and the readers of what they answer (``/health``, ``/metrics``
samples)."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.local_serve import deploy_many, local_serve

ROOT = Path(__file__).resolve().parent.parent


def model_name(args: argparse.Namespace) -> str:
    return "meridian-tiny" if args.model == "tiny" else Path(args.model).stem


@contextlib.contextmanager
def running_apps(
    apps: dict[str, dict[str, Any]], args: argparse.Namespace
) -> Iterator[dict[str, str]]:
    """The two-node Ray cluster (``--head-cpus``, ``--node-cpus``) and one Serve
    application per entry of ``apps`` (name -> ``ServeConfig`` fields), route prefix
    ``/<name>``; yields each one's base URL once all answer ``/health`` with all their
    Serve replicas."""
    from actors.serving.config import ServeConfig

    threads = str(args.torch_threads)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    with local_serve(env, args.head_cpus, nodes=(args.node_cpus,)) as host:
        replicas = {name: ServeConfig.parse(f).groups[0].num_replicas for name, f in apps.items()}
        yield deploy_many(host, {name: (apps[name], replicas[name]) for name in apps}, 900)


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
