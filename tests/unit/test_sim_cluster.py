"""End-to-end runs of small simulated clusters: every request is accounted for, the block
pools stay consistent, and the simulator drives the runtime's own policy objects."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from policies.conductor import Conductor
from policies.scheduler import Scheduler
from sim.presets import COLOCATED_POLICIES, PD_POLICIES, ClusterConfig, build_cluster
from sim.synthetic import SyntheticSpec, generate
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager

SIM_DIR = Path(__file__).resolve().parents[2] / "sim"


def small(mode: str, policy: str, **kw) -> ClusterConfig:
    base = dict(
        mode=mode,
        policy=policy,
        instances=4,
        model="llama3-8b",
        gpu="H100",
        tp=1,
        block_size=16,
        prefill_cache_tokens=20_000,
        colocated_budget=512,
        prefill_budget=2048,
    )
    base.update(kw)
    return ClusterConfig(**base)


def workload(n=40, rate=4.0, seed=0):
    spec = SyntheticSpec(
        rate=rate,
        num_sessions=n,
        turns_mean=3,
        system_prompt_tokens=256,
        input_median=300,
        output_median=30,
        think_time=2.0,
        block_size=64,
        max_input=4000,
        seed=seed,
    )
    return generate(spec)


CASES = [("colocated", p, "none") for p in COLOCATED_POLICIES]  # the router's names
CASES += [("pd", p, "none") for p in PD_POLICIES]
CASES += [("pd", "conductor", a) for a in ("early", "predictive", "baseline")]


@pytest.mark.parametrize("mode,policy,admission", CASES)
def test_every_request_is_accounted_for(mode, policy, admission):
    # Tight SLOs and a fast replay force rejections in the admission modes.
    reqs = workload(rate=50.0)
    cfg = small(mode, policy, admission=admission, tbt_slo=0.01, ttft_slo=0.02)
    cluster = build_cluster(cfg)
    stats = cluster.run([r for r in reqs])
    assert len(stats) == len(reqs)
    done = [s for s in stats if s.done]
    rejected = [s for s in stats if s.rejected is not None]
    assert len(done) + len(rejected) == len(reqs)
    assert all(s.finish is not None for s in stats)
    for s in done:
        assert s.ttft is not None and s.ttft > 0 and s.tbt is not None
    cluster.check_integrity()
    for inst in cluster.instances():
        assert not inst.scheduler.has_unfinished()
        assert inst.pool.num_in_use == 0  # every block freed exactly once
    if admission in ("early", "predictive", "baseline"):
        assert rejected, "the tight SLOs should have rejected something"


def test_prefix_sharing_reaches_the_real_block_pool():
    cluster = build_cluster(small("colocated", "prefix_aware"))
    stats = cluster.run(workload())
    assert sum(s.cached_tokens for s in stats) > 0


def test_sim_defines_no_scheduler_router_or_conductor():
    pattern = re.compile(r"^\w*(Scheduler|Router|Conductor)$")
    for path in SIM_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        bad = [n for n in names if pattern.match(n)]
        assert not bad, f"{path.name} defines {bad}: the simulator must drive policies/ objects"
        # The CI grep, verbatim.
        assert not re.search(r"^class \w*(Scheduler|Router|Conductor)\b", path.read_text(), re.M)


def test_sim_uses_the_runtime_policy_classes():
    pd = build_cluster(small("pd", "conductor"))
    assert type(pd.conductor) is Conductor
    col = build_cluster(small("colocated", "prefix_aware"))
    assert type(col.policy).__module__ == "policies.routing"
    for cluster in (pd, col):
        for inst in cluster.instances():
            assert type(inst.scheduler) is Scheduler
            assert type(inst.kv) is KVCacheManager
            assert type(inst.pool) is BlockPool
