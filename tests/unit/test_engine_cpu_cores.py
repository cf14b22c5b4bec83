"""``cpu_cores``: the serving loop runs its engine thread on the given cores only (and
leaves every other thread as it was); the option is checked when the config is built."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
from test_engine_loop_stream import CountingEngine

from actors.engine.config import EngineConfig
from actors.serving.engine_loop import EngineLoop

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


class AffinityRecordingEngine(CountingEngine):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[frozenset[int]] = set()

    def step(self):
        self.seen.add(frozenset(os.sched_getaffinity(0)))  # 0: the calling thread
        return super().step()


def test_engine_thread_runs_on_the_given_core_only():
    caller_before = os.sched_getaffinity(0)
    core = max(caller_before)
    engine = AffinityRecordingEngine()
    loop = EngineLoop(engine, cpu_cores=[core])  # type: ignore[arg-type]

    async def run() -> list:
        return [item async for item in loop.stream([SimpleNamespace(request_id="r")])]

    try:
        items = asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        loop.shutdown()
    assert items and engine.seen == {frozenset({core})}
    assert os.sched_getaffinity(0) == caller_before  # only the engine thread moved


def test_unpinned_engine_thread_keeps_the_process_cores():
    engine = AffinityRecordingEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]

    async def run() -> list:
        return [item async for item in loop.stream([SimpleNamespace(request_id="r")])]

    try:
        asyncio.run(asyncio.wait_for(run(), 10))
    finally:
        loop.shutdown()
    assert engine.seen == {frozenset(os.sched_getaffinity(0))}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cpu_cores": []}, "non-empty list of core ids"),
        ({"cpu_cores": [-1]}, "non-empty list of core ids"),
        ({"cpu_cores": [os.cpu_count()]}, "non-empty list of core ids"),
        ({"cpu_cores": ["0"]}, "non-empty list of core ids"),
        ({"cpu_cores": [0], "tp": 2}, "tp = spp = kvp = 1"),
        ({"cpu_cores": [0], "attention_workers": 1, "expert_workers": 1}, "no MoE workers"),
    ],
)
def test_bad_cpu_cores_are_refused_naming_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_disaggregated_deployment_refuses_cpu_cores_before_starting_anything():
    from actors.disagg.cluster_config import PDClusterConfig

    with pytest.raises(ValueError, match="prefill and decode replicas do not take it"):
        PDClusterConfig(engine=EngineConfig(cpu_cores=[0]))


def test_good_cpu_cores_are_kept():
    assert EngineConfig.from_options(cpu_cores=[0]).cpu_cores == [0]
