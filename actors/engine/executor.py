"""How a replica controller reaches its workers: the executor interface, and the in-process
executor (one worker in the controller's own process, the single-process reference).

``submit(plan)`` starts a step and returns a handle; ``result(handle)`` returns the sampled
tokens (request id -> token) of every KVP rank, in submission order. Up to ``depth`` steps
may be in flight (pipeline stages keep several). A dead worker surfaces as
``WorkerFailure`` from ``result``; ``restart()`` then brings up a fresh worker group with empty
KV caches, and the controller recomputes what was lost.

Optional (the controller refuses with a clear error where an executor lacks them):
``update_weights(weights)``: every worker loads the checked weights, and a worker restarted
later loads them again; ``sleep(level) -> bytes freed`` and ``wake_up()``.
"""

from __future__ import annotations

from typing import Any, Protocol

from actors.engine.step_plan import StepPlan, StepResult
from actors.engine.worker import Worker, WorkerSpec
from actors.engine.worker_hooks import HooksFactory, WorkerHooks


class WorkerFailure(RuntimeError):
    """A worker of the replica died or stopped answering; in-flight steps are lost."""


class Executor(Protocol):
    depth: int

    def submit(self, plan: StepPlan) -> Any: ...

    def result(self, handle: Any) -> StepResult: ...

    def restart(self) -> None: ...

    def hook_info(self) -> list[Any]:
        """Each worker's ``hook_info()``, in world-rank order."""
        ...

    def on_idle(self) -> None:
        """No step is coming soon: release what busy-waits (compiled-graph polling)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One worker, called directly: ``submit`` runs the step to completion."""

    depth = 1

    def __init__(self, spec: WorkerSpec, hooks: WorkerHooks | HooksFactory | None = None) -> None:
        if spec.layout.world_size != 1:
            raise ValueError("the in-process executor runs exactly one worker; use RayExecutor")
        self.spec = spec
        self.hooks = hooks
        self.worker = Worker(spec, hooks=hooks)
        self.worker.setup()
        self._updates: list[Any] = []  # every weight update, oldest first

    def submit(self, plan: StepPlan) -> StepResult:
        out = self.worker.execute(plan)
        assert isinstance(out, StepResult)
        return out

    def result(self, handle: StepResult) -> StepResult:
        return handle.read()

    def hook_info(self) -> list[Any]:
        return [self.worker.hook_info()]

    def restart(self) -> None:
        self.worker = Worker(self.spec, hooks=self.hooks)
        self.worker.setup()
        if self._updates:
            self.worker.update_weights(*self._updates)

    def update_weights(self, weights: Any) -> None:
        self.worker.update_weights(weights)
        self._updates.append(weights)

    def sleep(self, level: int) -> int:
        return self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def on_idle(self) -> None:
        pass  # nothing polls in process

    def shutdown(self) -> None:
        self.worker.shutdown()
