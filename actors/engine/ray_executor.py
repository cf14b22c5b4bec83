"""A replica's worker group on Ray: worker actors in placement groups, driven once per
iteration through a compiled graph (or plain actor calls, for comparison).

Placement (``placement.worker_group``): a layout that fits one node is one placement group
there; a larger one spreads whole TP groups over nodes, one placement group per node.

Graph shape, per KVP rank k and TP rank t: ``plan -> stage 0 -> stage 1 -> ... -> last``,
where every stage gets the plan from the input node and the previous stage's activations
over a compiled-graph channel (shared memory on one node). All last stages are outputs;
TP rank 0 of each KVP rank carries the sampled tokens. The graph is compiled with
``_max_inflight_executions = spp`` so a pipeline of ``spp`` stages holds ``spp`` steps.

An idle compiled-graph actor busy-polls its input channel (~one core each); ``on_idle``
tears the graph down, and the next ``submit`` compiles it again.

A dead actor makes ``result`` raise ``WorkerFailure``; ``restart`` kills what is left of
the group and starts a fresh one.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine.executor import WorkerFailure
from actors.engine.step_plan import StepPlan, StepResult
from actors.engine.worker import Worker, WorkerSpec
from actors.engine.worker_hooks import HooksFactory
from actors.ray_nodes import alive_nodes
from models.weight_update import SharedWeights, is_object_ref, read_weights
from placement.worker_group import plan_worker_group, worker_bundle

# Errors that mean a worker (or its node) is gone, not that the step itself was wrong.
_DEATH = (
    ray.exceptions.ActorDiedError,
    ray.exceptions.RayActorError,
    ray.exceptions.RayChannelError,
    ray.exceptions.RayChannelTimeoutError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.NodeDiedError,
)


def teardown_quietly(graph: Any) -> None:
    """Tear a compiled graph down (None: nothing to do), leaving its actors alive; a dead
    actor may make the teardown fail, which leaves nothing to tear down."""
    if graph is None:
        return
    try:
        graph.teardown(kill_actors=False)
    except Exception:  # noqa: BLE001
        pass


class RayExecutor:
    def __init__(
        self,
        spec: WorkerSpec,
        *,
        use_compiled_graph: bool = True,
        num_cpus_per_worker: float = 0.0,
        step_timeout_s: float = 120.0,
        setup_timeout_s: float = 300.0,
        worker_cls: type = Worker,
        hooks: HooksFactory | None = None,
        resources: dict[str, float] | None = None,
    ) -> None:
        """``worker_cls``: the worker class to make remote (anything with ``Worker``'s
        methods; the control-plane benchmark passes one that skips the model).
        ``resources``: custom Ray resources each worker reserves (a region's node
        resource pins the workers to that region's nodes)."""
        self.spec = spec
        self.worker_cls = worker_cls
        self.hooks = hooks  # each worker builds its hooks from it, in its own process
        self.layout = spec.layout
        self.use_compiled_graph = use_compiled_graph
        self.depth = spec.layout.spp
        self.num_cpus_per_worker = num_cpus_per_worker
        self.resources = dict(resources or {})
        self.step_timeout_s = step_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.actors: list[Any] = []
        self.node_ids: list[str] = []
        self._graph: Any = None
        self._pgs: list[Any] = []
        self._updates: list[Any] = []  # object refs of every weight update, oldest first
        if not ray.is_initialized():
            ray.init()
        self._start()

    # -- worker group -----------------------------------------------------------------------
    def _start(self) -> None:
        layout = self.layout
        bundle = worker_bundle(
            self.num_cpus_per_worker,
            gpus=1 if self.spec.device == "cuda" else 0,
            extra=self.resources,
        )
        plan = plan_worker_group(layout.tp, layout.spp, layout.kvp, bundle, alive_nodes())
        # One placement group per node the plan uses, each ready before the next is asked
        # for (the plan sized them largest node first).
        for group in plan.groups:
            self._pgs.append(placement_group(list(group.bundles), strategy=group.strategy))
            try:
                ray.get(self._pgs[-1].ready(), timeout=self.setup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                self._remove_placement_groups()
                raise RuntimeError(
                    f"the cluster cannot place {layout.world_size} workers ({bundle} each) for "
                    f"layout tp={layout.tp} spp={layout.spp} kvp={layout.kvp}"
                ) from None
        remote: Any = ray.remote(self.worker_cls)
        self.actors = []
        for coords in layout.coords():  # world-rank order
            pg_index, bundle_index = plan.slot(*coords)
            strategy = PlacementGroupSchedulingStrategy(self._pgs[pg_index], bundle_index)
            self.actors.append(
                remote.options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    resources=self.resources,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote(self.spec, coords, self.hooks)
            )
        # where each worker runs, by world rank (Ray node ids)
        self.node_ids = ray.get(
            [a.node_id.remote() for a in self.actors], timeout=self.setup_timeout_s
        )
        init_method = None
        if layout.world_size > 1:
            ip = ray.get(self.actors[0].node_ip.remote(), timeout=self.setup_timeout_s)
            port = ray.get(self.actors[0].free_port.remote(), timeout=self.setup_timeout_s)
            init_method = f"tcp://{ip}:{port}"
        ray.get([a.setup.remote(init_method) for a in self.actors], timeout=self.setup_timeout_s)
        if self._updates:  # a restarted group loads the weights as last updated
            self._on_all("update_weights", *self._updates)

    def _on_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker outside the compiled graph (torn down first:
        its actors run nothing else while it is up); a dead worker raises WorkerFailure."""
        self._teardown()
        try:
            refs = [getattr(a, method).remote(*args) for a in self.actors]
            return list(ray.get(refs, timeout=self.setup_timeout_s))
        except _DEATH as exc:
            raise WorkerFailure(f"a worker of the replica died: {exc}") from exc

    def _actor(self, tp_rank: int, stage: int, kvp_rank: int) -> Any:
        return self.actors[self.layout.world_rank(tp_rank, stage, kvp_rank)]

    def _wire(self, call: Any, plan: Any) -> list[Any]:
        """Per KVP rank and TP rank, stage 0 gets the plan and stage s > 0 also stage s - 1's
        output: ``call(actor, plan, *previous)``. Returns the last stages' outputs, KVP rank
        major (so TP rank 0 of KVP rank k is at ``k * tp``)."""
        layout = self.layout
        outputs = []
        for k in range(layout.kvp):
            prev: list[Any] = []
            for s in range(layout.spp):
                prev = [
                    call(self._actor(t, s, k), plan, *([prev[t]] if s else []))
                    for t in range(layout.tp)
                ]
            outputs.extend(prev)
        return outputs

    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode(self._wire(lambda a, *args: a.execute.bind(*args), plan))
        return dag.experimental_compile(_max_inflight_executions=self.depth)

    # -- steps ------------------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> Any:
        try:
            if not self.use_compiled_graph:
                return self._submit_plain(plan)
            if self._graph is None:
                self._graph = self._compile()
            return self._graph.execute(plan)
        except _DEATH as exc:
            return exc  # surfaced by result(), in order

    def _submit_plain(self, plan: StepPlan) -> list[Any]:
        return self._wire(lambda a, *args: a.execute.remote(*args), plan)

    def result(self, handle: Any) -> StepResult:
        if isinstance(handle, BaseException):
            raise WorkerFailure(f"a worker of the replica died: {handle}") from handle
        try:
            outs = ray.get(handle, timeout=self.step_timeout_s)
        except _DEATH as exc:
            raise WorkerFailure(f"a worker of the replica died: {exc}") from exc
        tp = self.layout.tp
        leaders = outs[::tp]  # TP rank 0 of each KVP rank's last stage
        merged = StepResult(leaders[0].step_id, {}, list(leaders[0].timings))
        for out in leaders:
            merged.tokens.update(out.tokens)
            merged.logprobs.update(out.logprobs)
        for out in outs:  # every last stage carries its earlier stages' reports
            merged.hook_reports += out.hook_reports
        return merged

    def hook_info(self) -> list[Any]:
        return list(ray.get([a.hook_info.remote() for a in self.actors]))

    # -- lifecycle ----------------------------------------------------------------------------
    def on_idle(self) -> None:
        """Tear the compiled graph down so idle actors stop polling; recompiled on demand."""
        self._teardown()

    def _teardown(self) -> None:
        graph, self._graph = self._graph, None
        teardown_quietly(graph)

    def alive(self) -> bool:
        """Whether every worker still answers a no-op call. Only while no compiled graph is
        up (True otherwise): its actors answer nothing else, and a step finds a dead one."""
        if self._graph is not None:
            return True
        try:
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=self.step_timeout_s)
        except _DEATH:
            return False
        return True

    def restart(self) -> None:
        self._kill()
        self._start()

    def update_weights(self, weights: Any) -> None:
        """The tensors go into the object store once (a ref passes through as is) and every
        worker on a node reads them from there."""
        ref = (
            weights if is_object_ref(weights) else ray.put(SharedWeights.of(read_weights(weights)))
        )
        self._on_all("update_weights", ref)
        self._updates.append(ref)

    def sleep(self, level: int) -> int:
        return sum(self._on_all("sleep", level))

    def wake_up(self) -> None:
        self._on_all("wake_up")

    def _kill(self) -> None:
        self._teardown()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self._remove_placement_groups()
        time.sleep(0.1)  # let the raylet return the bundles before they are asked for again

    def _remove_placement_groups(self) -> None:
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs = []

    def shutdown(self) -> None:
        self._kill()
