"""LLM-aware autoscaling on plain data: the decision (``policies.autoscaling``), Serve's
policy adapter on a stand-in context, the config section and what it maps to in Serve."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from actors.serving.config import ReplicaGroupConfig, ServeConfig
from policies.autoscaling import (
    LLMAutoscalingPolicy,
    ReplicaLoad,
    ScalingTargets,
    desired_replicas,
    replica_need,
)
from policies.replica_stats import ReplicaStats

TARGETS = ScalingTargets(queued_prefill_tokens=1000, kv_usage=0.5, downscale_threshold=0.7)


def load(prefill: float = 0, kv: float = 0, running: float = 0, waiting: float = 0) -> ReplicaLoad:
    return ReplicaLoad(prefill, kv, running, waiting)


def decide(loads: list[ReplicaLoad], current: int, lo: int = 1, hi: int = 3) -> int:
    return desired_replicas(loads, current, lo, hi, TARGETS).replicas


def test_load_from_stats_and_back_through_metrics():
    stats = ReplicaStats(3, 5, 1200, 10, 64, 0.75, 0.5, time=1.0)
    got = ReplicaLoad.of(stats)
    assert got == ReplicaLoad(1200.0, 0.75, 3.0, 5.0)
    metrics = got.as_metrics()
    assert all(k.startswith("meridian_") and isinstance(v, float) for k, v in metrics.items())
    assert ReplicaLoad.from_metrics(metrics) == got
    assert ReplicaLoad.from_metrics({}) == ReplicaLoad()


def test_queued_prefill_tokens_scale_up_even_with_few_requests():
    # one replica, 2 requests but 2500 prompt tokens queued: 2.5 replicas' worth
    need, signal = replica_need([load(prefill=2500, kv=0.1, running=1, waiting=1)], TARGETS)
    assert (need, signal) == (2.5, "queued_prefill_tokens")
    assert decide([load(prefill=2500, kv=0.1, running=1, waiting=1)], current=1) == 3


def test_kv_usage_scales_up_when_prefill_is_done():
    # both replicas decode with full caches: 0.9 + 0.8 = 1.7 / 0.5 = 3.4 -> 4, capped at 3
    d = desired_replicas([load(kv=0.9), load(kv=0.8)], 2, 1, 3, TARGETS)
    assert d.signal == "kv_usage" and d.need == pytest.approx(3.4) and d.replicas == 3
    assert decide([load(kv=0.6), load(kv=0.5)], current=2, hi=8) == 3


def test_request_counts_only_when_targeted():
    many = [load(running=20, waiting=10)]
    assert decide(many, current=1) == 1  # no request target: 30 requests of nothing to do
    by_requests = ScalingTargets(queued_prefill_tokens=1000, kv_usage=0.5, requests=8)
    d = desired_replicas(many, 1, 1, 8, by_requests)
    assert (d.replicas, d.signal) == (4, "requests")


def test_hysteresis_holds_a_size_near_its_boundary():
    # 3 replicas; the load is 2.5 replicas' worth: not over 3, and 2 would be over 0.7 x target
    three = [load(kv=0.5), load(kv=0.4), load(kv=0.35)]  # 1.25 / 0.5 = 2.5
    assert decide(three, current=3) == 3
    # the same load with 2 replicas scales up to 3: up at the target, down only well below it
    assert decide(three, current=2) == 3
    # 1.3 replicas' worth: ceil(1.3 / 0.7) = 2
    assert decide([load(kv=0.25), load(kv=0.2), load(kv=0.2)], current=3) == 2
    # an idle group goes to its minimum
    assert decide([load(), load(), load()], current=3) == 1
    assert decide([load(), load(), load()], current=3, lo=2) == 2


def test_exact_boundaries_and_bounds():
    assert decide([load(prefill=1000)], current=1) == 1  # exactly at the target: stays
    assert decide([load(prefill=1001)], current=1) == 2
    assert decide([load(prefill=10**9)], current=1, hi=5) == 5
    assert decide([], current=2) == 1  # nobody reported yet: no load
    with pytest.raises(ValueError, match="min_replicas"):
        desired_replicas([], 1, 3, 2, TARGETS)
    with pytest.raises(ValueError, match="kv_usage"):
        ScalingTargets(kv_usage=1.5)


def test_scaling_is_monotone_in_load():
    sizes = [decide([load(prefill=p)], current=1, hi=10) for p in range(0, 10_000, 250)]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 10


def context(metrics: dict[str, dict[Any, float]], target: int, lo: int = 1, hi: int = 3) -> Any:
    return SimpleNamespace(
        aggregated_metrics=metrics,
        target_num_replicas=target,
        current_num_replicas=target,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
    )


def test_serve_policy_reads_replica_metrics_from_the_context():
    policy = LLMAutoscalingPolicy(queued_prefill_tokens=1000, kv_usage=0.5)
    a, b = load(prefill=1800, kv=0.3).as_metrics(), load(prefill=600, kv=0.2).as_metrics()
    metrics: dict[str, dict[Any, float]] = {}
    for rid, m in (("r1", a), ("r2", b)):
        for name, value in m.items():
            metrics.setdefault(name, {})[rid] = value
    metrics["some_other_metric"] = {"r1": 1e9}  # not ours: ignored
    replicas, state = policy(context(metrics, target=2))
    assert replicas == 3 and state["meridian_signal"] == "queued_prefill_tokens"
    assert state["meridian_need"] == pytest.approx(2.4)
    # a replica still starting has no metrics: it counts toward the size, not the load
    replicas, _ = policy(context({k: {"r1": v} for k, v in a.items()}, target=3))
    assert replicas == 3
    assert policy(context({}, target=3))[0] == 1
    assert policy(SimpleNamespace(**{**vars(context({}, 2)), "aggregated_metrics": None}))[0] == 1


# -- the config section -----------------------------------------------------------------------
def test_autoscaling_section_maps_onto_serve_autoscaling_config():
    g = ReplicaGroupConfig(
        name="main",
        autoscaling={"max_replicas": 3, "target_queued_prefill_tokens": 256, "upscale_delay_s": 1},
    )
    assert g.autoscaling is not None and g.num_replicas == 1  # starts at min_replicas
    serve_cfg = g.autoscaling.serve_config()
    assert (serve_cfg["min_replicas"], serve_cfg["max_replicas"]) == (1, 3)
    assert serve_cfg["initial_replicas"] == 1 and serve_cfg["upscale_delay_s"] == 1
    policy = serve_cfg["policy"]
    assert policy["policy_function"] == "policies.autoscaling:LLMAutoscalingPolicy"
    assert ScalingTargets(**policy["policy_kwargs"]).queued_prefill_tokens == 256
    g2 = ReplicaGroupConfig(autoscaling={"max_replicas": 4, "initial_replicas": 2})
    assert g2.num_replicas == 2
    # the config round-trips (Serve passes it to every replica as a dump)
    cfg = ServeConfig(groups=[g2.model_dump()])
    assert ServeConfig.model_validate(cfg.model_dump()) == cfg


def error(**group: Any) -> str:
    with pytest.raises(ValidationError) as e:
        ReplicaGroupConfig(**group)
    return str(e.value)


def test_autoscaling_errors_name_the_field():
    assert "max_replicas" in error(autoscaling={"min_replicas": 1})  # required
    assert "autoscaling.max_replicas (1) must be >= autoscaling.min_replicas (2)" in error(
        autoscaling={"min_replicas": 2, "max_replicas": 1}
    )
    assert "autoscaling.initial_replicas (5)" in error(
        autoscaling={"max_replicas": 3, "initial_replicas": 5}
    )
    assert "target_kv_usage" in error(autoscaling={"max_replicas": 2, "target_kv_usage": 1.5})
    assert "look_back_period_s" in error(
        autoscaling={"max_replicas": 2, "look_back_period_s": 1, "metrics_interval_s": 1}
    )
    assert "num_replicas (2) conflicts with autoscaling" in error(
        num_replicas=2, autoscaling={"max_replicas": 3}
    )
    assert "autoscaling is for colocated groups" in error(
        num_prefill=1, num_decode=1, autoscaling={"max_replicas": 3}
    )
    assert "unknown_key" in error(autoscaling={"max_replicas": 3, "unknown_key": 1})


def test_serve_app_sets_autoscaling_instead_of_num_replicas():
    from serve_app import _scaling_options

    fixed = _scaling_options(ReplicaGroupConfig(num_replicas=3))
    assert fixed == {"num_replicas": 3}
    g = ReplicaGroupConfig(autoscaling={"max_replicas": 3, "drain_timeout_s": 45})
    opts = _scaling_options(g)
    assert "num_replicas" not in opts and opts["graceful_shutdown_timeout_s"] == 45
    from ray.serve.config import AutoscalingConfig

    serve_cfg = AutoscalingConfig(**opts["autoscaling_config"])  # Serve accepts it as is
    assert serve_cfg.max_replicas == 3
    assert serve_cfg.policy.policy_function == "policies.autoscaling:LLMAutoscalingPolicy"


# -- membership and draining --------------------------------------------------------------------
def test_router_learns_a_new_replica_and_forgets_one_that_left():
    import asyncio

    from actors.serving.metrics import ReplicaMetrics
    from actors.serving.router import RouterDeployment
    from policies.routing import RouteRequest

    def stats() -> ReplicaStats:
        return ReplicaStats(0, 0, 0, 64, 64, 0.0, 0.0, time=0.0)

    async def run() -> None:
        router = RouterDeployment("least_loaded", block_size=16)
        snap = ReplicaMetrics().snapshot()
        await router.report("a", "main", stats(), snap, [], None, True)
        assert [r for r, _ in await router.route(RouteRequest("q0", [], 8))] == ["a"]
        await router.report("b", "main", stats(), snap, [], None, True)  # scaled up: joins
        ranked = {r for r, _ in await router.route(RouteRequest("q1", [], 8))}
        assert ranked == {"a", "b"}
        await router.leave("b")  # scaled down: drained, then left
        assert [r for r, _ in await router.route(RouteRequest("q2", [], 8))] == ["a"]
        # a push that was in flight as it left does not bring it back
        assert await router.report("b", "main", stats(), snap, [], None, False) is False
        assert list(await router.snapshot()) == ["a"]
        await router.leave("never-seen")  # harmless

    asyncio.run(run())


class SlowEngine:
    """A ``ServingEngine`` stand-in: each request finishes after ``steps`` steps of 10 ms."""

    block_size = 16
    limits: Any = None

    def __init__(self, steps: int) -> None:
        from actors.engine.outputs import RequestOutput

        self.steps = steps
        self.left: dict[str, int] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.aborted: list[str] = []
        self.make_output = RequestOutput

    def add_request(self, request: Any) -> str:
        self.left[request.request_id] = self.steps
        self.outputs[request.request_id] = self.make_output(request.request_id, [1, 2, 3])
        return str(request.request_id)

    def step(self) -> list[Any]:
        import time

        from actors.engine.outputs import StreamDelta

        time.sleep(0.01)
        deltas = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            out = self.outputs[rid]
            out.token_ids.append(7)
            if done:
                del self.left[rid]
                out.finished, out.finish_reason = True, "length"
            deltas.append(StreamDelta(rid, [7], "x", done, "length" if done else None))
        return deltas

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.left.pop(request_id, None)

    def release(self, request_id: str) -> Any:
        return self.outputs.pop(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def on_idle(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def serving_stats(self) -> ReplicaStats:
        return ReplicaStats(len(self.left), 0, 0, 64, 64, 0.0, 0.0, time=0.0)

    def cached_block_hashes(self) -> list[int]:
        return []

    def drain_cache_events(self) -> list[tuple[str, int]]:
        return []

    def check_blocks(self) -> dict[str, int]:
        return {}


def test_a_draining_loop_finishes_what_it_holds_before_it_stops():
    import threading

    from actors.engine.events import Done, Failed
    from actors.serving.engine_loop import EngineLoop
    from actors.serving.open_prompt import OpenPrompt

    engine = SlowEngine(steps=30)  # ~0.3 s of work
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    got: list[Any] = []
    finished = threading.Event()

    class Outlet:
        def send(self, batch: list[Any]) -> None:
            for _, events in batch:
                for item in events:
                    if item is not None:
                        got.append(item)
                    if isinstance(item, Done | Failed):
                        finished.set()

    def prompt(rid: str) -> OpenPrompt:
        return OpenPrompt([SimpleNamespace(request_id=rid)], Outlet(), got.append)  # type: ignore[list-item]

    try:
        loop.submit(prompt("r1"))
        assert loop.drain(timeout=10)  # waits for the request, not the timeout
        assert finished.is_set() and isinstance(got[-1], Done) and not engine.aborted
        assert len(got[-1].output.token_ids) == 30
        assert loop.drain(timeout=0.1)  # idle: at once
        engine.steps = 10_000
        loop.submit(prompt("r2"))
        assert not loop.drain(timeout=0.2)  # bounded: gives up and says so
    finally:
        loop.shutdown()
    assert isinstance(got[-1], Failed) and engine.aborted == ["r2"]  # what was left fails
