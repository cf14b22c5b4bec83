"""A disaggregated MoE replica on Ray: attention and expert workers as actors, each step one
execution of a compiled graph whose channels carry the M2N and N2M messages.

Graph, for ``L`` layers, ``m`` micro-batches, ``n_a`` attention and ``n_e`` expert workers:
round ``(l, j)`` binds ``attention_round(l, j, ...)`` on every attention actor (the plan
for ``l = 0``, else the ``n_e`` replies of round ``(l - 1, j)`` addressed to it), with
``num_returns = n_e`` so each expert actor reads only its own ``ExpertBatch``; then
``expert_round(l, j, ...)`` on every expert actor with the ``n_a`` batches addressed to it
and ``num_returns = n_a``. Round ``(L, j)`` samples; its results are the graph's outputs.
Rounds are bound layer-major, and each actor runs its methods in bind order as their inputs
arrive, so attention actors compute micro-batch j + 1 while expert actors compute j: the
ping-pong pipeline. Every edge is a shared-memory channel (one node, CPU): every expert
actor receives a message every round, empty or not.

Like ``RayExecutor``: the graph is torn down when the replica idles (idle actors poll their
channels), a dead actor makes ``result`` raise ``WorkerFailure`` and ``restart`` starts a
fresh set of workers (the controller then recomputes the running requests' KV).
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import ray

from actors.engine.executor import WorkerFailure
from actors.engine.ray_executor import _DEATH, CHANNEL_BYTES
from actors.engine.step_plan import StepPlan, StepResult
from actors.moe.executor import merge_results
from actors.moe.messages import MoESpec, StageTime
from actors.moe.workers import AttentionWorker, ExpertWorker
from models.config import read_model_config


def _outputs(node: Any, n: int) -> list[Any]:
    """A bound method's ``n`` output nodes (one node, not a tuple, when ``n == 1``)."""
    return list(node) if n > 1 else [node]


class RayMoEExecutor:
    depth = 1

    def __init__(
        self,
        spec: MoESpec,
        *,
        num_cpus_per_worker: float = 0.0,
        step_timeout_s: float = 120.0,
        setup_timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        self.num_layers = read_model_config(spec.model_dir).num_hidden_layers
        self.num_cpus_per_worker = num_cpus_per_worker
        self.step_timeout_s = step_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.timeline: deque[tuple[int, list[StageTime]]] = deque(maxlen=64)  # last steps
        self.attention: list[Any] = []
        self.experts: list[Any] = []
        self._graph: Any = None
        self._env = {"RAY_CGRAPH_buffer_size_bytes": str(CHANNEL_BYTES)}
        os.environ.setdefault("RAY_CGRAPH_buffer_size_bytes", str(CHANNEL_BYTES))
        if not ray.is_initialized():
            ray.init(runtime_env={"env_vars": self._env})
        self._start()

    # -- workers ----------------------------------------------------------------------------
    def _start(self) -> None:
        spec = self.spec
        options = dict(
            num_cpus=self.num_cpus_per_worker,
            num_gpus=1 if spec.device == "cuda" else 0,
            runtime_env={"env_vars": self._env},
            max_restarts=0,
        )
        attention: Any = ray.remote(AttentionWorker)
        expert: Any = ray.remote(ExpertWorker)
        self.attention = [
            attention.options(**options).remote(spec, a) for a in range(spec.attention_workers)
        ]
        self.experts = [
            expert.options(**options).remote(spec, w) for w in range(spec.expert_workers)
        ]
        # Load the model (and import torch) in every actor before the graph is compiled: a
        # first execute that does it can pass the channels' timeout.
        ray.get(
            [w.setup.remote() for w in [*self.attention, *self.experts]],
            timeout=self.setup_timeout_s,
        )

    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        n_a, n_e = len(self.attention), len(self.experts)
        m, layers = self.spec.micro_batches, self.num_layers
        outputs: list[Any] = []
        replies: dict[int, list[list[Any]]] = {}  # micro-batch -> [expert w][attention a]
        with InputNode() as plan:
            for layer in range(layers + 1):
                for j in range(m):
                    sent: list[list[Any]] = []  # [attention a][expert w]
                    for a, actor in enumerate(self.attention):
                        args = [plan] if layer == 0 else [replies[j][w][a] for w in range(n_e)]
                        if layer == layers:
                            outputs.append(actor.attention_round.bind(layer, j, *args))
                        else:
                            node = actor.attention_round.options(num_returns=n_e).bind(
                                layer, j, *args
                            )
                            sent.append(_outputs(node, n_e))
                    if layer < layers:
                        replies[j] = [
                            _outputs(
                                actor.expert_round.options(num_returns=n_a).bind(
                                    layer, j, *(sent[a][w] for a in range(n_a))
                                ),
                                n_a,
                            )
                            for w, actor in enumerate(self.experts)
                        ]
            dag = MultiOutputNode(outputs)
        return dag.experimental_compile(_max_inflight_executions=1)

    # -- steps ------------------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> Any:
        try:
            if self._graph is None:
                self._graph = self._compile()
            return (plan.step_id, self._graph.execute(plan))
        except _DEATH as exc:
            return exc

    def result(self, handle: Any) -> StepResult:
        if isinstance(handle, BaseException):
            raise WorkerFailure(f"a MoE worker of the replica died: {handle}") from handle
        step_id, ref = handle
        try:
            outs = ray.get(ref, timeout=self.step_timeout_s)
        except _DEATH as exc:
            raise WorkerFailure(f"a MoE worker of the replica died: {exc}") from exc
        merged, times = merge_results(step_id, list(outs))
        self.timeline.append((step_id, times))
        return merged

    def token_counts(self) -> list[int]:
        """Rows each expert served since the last call, summed over its copies (tears the
        graph down first: a compiled-graph actor runs no other call)."""
        self._teardown()
        total = [0] * self.spec.placement.num_experts
        for counts in ray.get([w.take_counts.remote() for w in self.experts]):
            for e, c in enumerate(counts):
                total[e] += c
        return total

    def hook_info(self) -> list[Any]:
        return [None] * (len(self.attention) + len(self.experts))

    # -- lifecycle --------------------------------------------------------------------------
    def on_idle(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            try:
                graph.teardown(kill_actors=False)
            except Exception:  # noqa: BLE001 - a dead actor may make teardown fail
                pass

    def restart(self) -> None:
        self._kill()
        self._start()

    def _kill(self) -> None:
        self._teardown()
        for actor in [*self.attention, *self.experts]:
            ray.kill(actor, no_restart=True)
        self.attention, self.experts = [], []
        time.sleep(0.1)

    def shutdown(self) -> None:
        self._kill()
