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

import time
from typing import Any

import ray

from actors.engine.executor import WorkerFailure
from actors.engine.ray_executor import _DEATH, teardown_quietly
from actors.engine.step_plan import StepPlan, StepResult
from actors.moe.executor_base import MoEExecutorBase
from actors.moe.messages import MoESpec
from actors.moe.workers import AttentionWorker, ExpertWorker
from policies.expert_balance import ExpertBalancer, ExpertPlacement


def _outputs(node: Any, n: int) -> list[Any]:
    """A bound method's ``n`` output nodes (one node, not a tuple, when ``n == 1``)."""
    return list(node) if n > 1 else [node]


class RayMoEExecutor(MoEExecutorBase):
    def __init__(
        self,
        spec: MoESpec,
        balancer: ExpertBalancer | None = None,
        *,
        num_cpus_per_worker: float = 0.0,
        step_timeout_s: float = 120.0,
        setup_timeout_s: float = 300.0,
        resources: dict[str, float] | None = None,  # custom Ray resources per worker
        attention_resources: dict[str, float] | None = None,  # more, per attention worker
        expert_resources: dict[str, float] | None = None,  # more, per expert worker
    ) -> None:
        super().__init__(spec, balancer)
        self.num_cpus_per_worker = num_cpus_per_worker
        self.resources = dict(resources or {})
        self.kind_resources = {
            "attention": {**self.resources, **(attention_resources or {})},
            "expert": {**self.resources, **(expert_resources or {})},
        }
        # the cores each worker's process runs on, as it reported them after pinning
        # (``spec.attention_cores`` / ``expert_cores``)
        self.cores: dict[str, list[list[int]]] = {"attention": [], "expert": []}
        self.step_timeout_s = step_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.attention: list[Any] = []
        self.experts: list[Any] = []
        self._graph: Any = None
        if not ray.is_initialized():
            ray.init()
        self._start()

    # -- workers ----------------------------------------------------------------------------
    def _options(self, kind: str) -> dict[str, Any]:
        return dict(
            num_cpus=self.num_cpus_per_worker,
            num_gpus=1 if self.spec.device == "cuda" else 0,
            resources=self.kind_resources[kind],
            max_restarts=0,
        )

    def _start(self) -> None:
        spec = self.spec
        attention: Any = ray.remote(AttentionWorker)
        self.attention = [
            attention.options(**self._options("attention")).remote(spec, a)
            for a in range(spec.attention_workers)
        ]
        self._start_experts()
        # Load the model (and import torch) in every actor before the graph is compiled: a
        # first execute that does it can pass the channels' timeout. Then pin: loading may
        # build CPU kernels, which one pinned core under load makes take minutes.
        ray.get([w.setup.remote() for w in self.attention], timeout=self.setup_timeout_s)
        self.cores["attention"] = ray.get(
            [w.pin.remote() for w in self.attention], timeout=self.setup_timeout_s
        )

    def _start_experts(self) -> None:
        expert: Any = ray.remote(ExpertWorker)
        self.experts = [
            expert.options(**self._options("expert")).remote(self.spec, w)
            for w in range(self.spec.expert_workers)
        ]
        ray.get([w.setup.remote() for w in self.experts], timeout=self.setup_timeout_s)
        self.cores["expert"] = ray.get(
            [w.pin.remote() for w in self.experts], timeout=self.setup_timeout_s
        )

    def _apply_placement(self, placement: ExpertPlacement) -> None:
        """New expert actors holding the new placement's experts; the attention actors keep
        their KV and route by it from the next step (the graph is compiled again)."""
        self._teardown()
        ray.get([a.set_placement.remote(placement) for a in self.attention])
        for actor in self.experts:
            ray.kill(actor, no_restart=True)
        self._start_experts()

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
        return self._record(step_id, list(outs))

    def hook_info(self) -> list[Any]:
        return [None] * (len(self.attention) + len(self.experts))

    # -- lifecycle --------------------------------------------------------------------------
    def on_idle(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        graph, self._graph = self._graph, None
        teardown_quietly(graph)

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
