"""Remote backends of the Python API (``actors.LLM``).

- ``ReplicaPool``: ``LLM(model, num_replicas=k)`` starts k ``ReplicaActor``s on the Ray
  cluster, builds each prompt's ``Request`` (limits checked, block hashes computed, once)
  and routes it itself with a ``RouterState`` (the same policies as the Serve app), fed by
  the replicas' block events and stats pulled before each submission window and updated by
  its own decisions.
- ``ServeAppClient``: ``LLM.attach("app-name")`` calls a running Serve app's ingress
  through a ``DeploymentHandle`` (same routing, tenants and limits as HTTP).
- ``HttpClient``: ``LLM.attach("http://host:8000")`` talks to any running server over its
  OpenAI API (``prompt`` as token ids, ``return_token_ids``).

Every backend offers ``run(token_lists, params, salt)``: an iterator of ``(index,
RequestOutput)`` in completion order, each index exactly once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from actors.engine.config import EngineConfig
from actors.engine.defaults import BATCH_MAX_IN_FLIGHT
from actors.engine.outputs import RequestOutput, TokenLogprob
from actors.engine.request_builder import RequestBuilder
from actors.engine.request_limits import RequestLimits
from actors.serving.router_state import RouterState
from errors import EngineUnavailableError, InvalidRequestError, MeridianError
from models.loader import expected_tensors
from models.weight_update import SharedWeights, checked_weights, is_object_ref, read_weights
from policies.request import Request, SamplingParams
from policies.routing import RouteRequest

Results = Iterator[tuple[int, RequestOutput]]


MAX_RETRIES = 3  # of one request that failed retriably (a weight update aborted it)


def _retriable(e: Exception) -> bool:
    return isinstance(getattr(e, "cause", None), EngineUnavailableError)


def _raise_cause(e: Exception) -> NoReturn:
    """Re-raise a remote MeridianError as itself (Ray wraps it in RayTaskError)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, MeridianError):
        raise cause from None
    raise e


class ReplicaPool:
    def __init__(
        self,
        model: str | None,
        num_replicas: int,
        routing: str = "prefix_aware",
        num_cpus: float = 0.0,
        engine_config: EngineConfig | None = None,
        max_in_flight: int = BATCH_MAX_IN_FLIGHT,
    ) -> None:
        import ray

        from actors.serving.replica import ReplicaActor, ReplicaInfo

        if num_replicas < 1:
            raise InvalidRequestError(f"num_replicas must be at least 1, got {num_replicas}")
        if not ray.is_initialized():
            ray.init()  # the cluster of RAY_ADDRESS / the job, else a local one
        actor: Any = ray.remote(ReplicaActor).options(num_cpus=num_cpus)
        config = engine_config or EngineConfig()
        self.model = model
        self.actors = [actor.remote(model, config) for _ in range(num_replicas)]
        infos: list[ReplicaInfo] = ray.get([a.ready.remote() for a in self.actors])
        self.block_size = config.block_size
        self.builder = RequestBuilder(
            self.block_size, RequestLimits.tightest([i.limits for i in infos])
        )
        self.ids = [f"replica-{i}" for i in range(num_replicas)]
        self.state = RouterState(routing, block_size=self.block_size)
        for rid, info in zip(self.ids, infos, strict=True):
            self.state.add_replica(rid, total_blocks=info.total_blocks)
        self.max_in_flight = max_in_flight

    def refresh(self) -> None:
        """Pull every replica's events and stats into the routing view."""
        import ray

        reports = ray.get([a.report.remote() for a in self.actors])
        for rid, (stats, events, resync) in zip(self.ids, reports, strict=True):
            if resync is not None:
                self.state.resync(rid, resync)
            self.state.on_events(rid, events)
            self.state.on_stats(rid, stats)

    def run(
        self, token_lists: list[list[int]], params: list[SamplingParams], salt: str | None
    ) -> Results:
        import ray

        requests = self.builder.build_each(token_lists, params, salt=salt)
        pending: dict[Any, int] = {}
        retries: dict[int, int] = {}
        todo = iter(range(len(token_lists)))
        try:
            while True:
                if len(pending) < self.max_in_flight:
                    self.refresh()
                    for i in todo:
                        pending[self._submit(requests[i])] = i
                        if len(pending) >= self.max_in_flight:
                            break
                if not pending:
                    return
                done, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(done[0])
                try:
                    out = ray.get(done[0])
                except ray.exceptions.RayTaskError as e:
                    retries[i] = retries.get(i, 0) + 1
                    if not _retriable(e) or retries[i] > MAX_RETRIES:
                        _raise_cause(e)
                    pending[self._submit(requests[i])] = i  # e.g. aborted by a weight update
                    continue
                yield i, out
        finally:
            for ref in pending:
                ray.cancel(ref)  # cancelling the actor task aborts its request

    def _submit(self, request: Request) -> Any:
        route = RouteRequest(request.request_id, request.block_hashes, request.num_prompt_tokens)
        ranking = self.state.route(route)
        actor = self.actors[self.ids.index(ranking[0])]
        return actor.generate.remote(request)

    def update_weights(self, weights: Any, abort_in_flight: bool = False) -> None:
        """Check ``weights`` here, put them in the object store once (``SharedWeights``:
        each replica on a node reads the one copy) and have every replica load them from
        there (``ReplicaActor.update_weights``). An object ref passes through as is."""
        import ray

        if not is_object_ref(weights):
            checked = checked_weights(self._expected_tensors(), weights)
            weights = ray.put(SharedWeights.of(checked))
        self._on_all("update_weights", [weights], abort_in_flight)

    def sleep(self, level: int = 1) -> int:
        return sum(self._on_all("sleep", level))

    def wake_up(self) -> None:
        self._on_all("wake_up")

    def _on_all(self, method: str, *args: Any) -> list[Any]:
        import ray

        try:
            return list(ray.get([getattr(a, method).remote(*args) for a in self.actors]))
        except ray.exceptions.RayTaskError as e:
            _raise_cause(e)
            raise

    def _expected_tensors(self) -> dict[str, tuple[int, ...]]:
        from models import tiny_model_dir

        return expected_tensors(self.model if self.model is not None else tiny_model_dir("dense"))

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []


def _json_params(p: SamplingParams) -> dict[str, Any]:
    """The OpenAI body fields of ``p`` (HTTP only; a Serve app takes SamplingParams)."""
    if p.stop_token_ids:
        raise InvalidRequestError("stop_token_ids cannot be sent over HTTP; use stop")
    fields = (
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stop",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logprobs",
        "logprobs_mode",
        "response_format",
    )
    body = {f: getattr(p, f) for f in fields}
    if p.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in p.logit_bias.items()}
    if p.logprobs is not None:
        body["return_tokens_as_token_ids"] = True  # top logprobs keyed by id, not by text
    return body


def _token_logprobs(body: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """A completions choice's logprobs (tokens named ``token_id:<id>``) -> TokenLogprobs."""
    if body is None:
        return None

    def tid(name: str) -> int:
        return int(name.removeprefix("token_id:"))

    return [
        TokenLogprob(tid(t), lp, tuple((tid(k), v) for k, v in top.items()))
        for t, lp, top in zip(
            body["tokens"], body["token_logprobs"], body["top_logprobs"], strict=True
        )
    ]


class ServeAppClient:
    def __init__(self, app_name: str, api_key: str | None = None) -> None:
        from ray import serve

        self.handle = serve.get_app_handle(app_name)
        self.api_key = api_key

    def run(
        self, token_lists: list[list[int]], params: list[SamplingParams], salt: str | None
    ) -> Results:
        if salt is not None:
            raise InvalidRequestError("an attached app salts by API key; pass api_key instead")
        response = self.handle.generate_tokens.remote(token_lists, list(params), self.api_key)
        try:
            outs = response.result()
        except Exception as e:
            _raise_cause(e)
        yield from enumerate(outs)

    def update_weights(self, weights: Any, abort_in_flight: bool = False) -> None:
        """Put ``weights`` (read here: tensors, or a path on this machine) in the object
        store once; the app's router checks them, keeps its own copy for replicas that
        start later, and every replica loads it (``actors/serving/weight_updates.py``)."""
        import ray

        if not is_object_ref(weights):
            weights = ray.put(SharedWeights.of(read_weights(weights)))
        try:  # in a list: the ref reaches the router as a ref
            self.handle.update_weights.remote([weights], abort_in_flight).result()
        except Exception as e:
            _raise_cause(e)

    def sleep(self, level: int = 1) -> int:
        try:
            freed = self.handle.sleep.remote(level).result()
        except Exception as e:
            _raise_cause(e)
        return int(freed)

    def wake_up(self) -> None:
        try:
            self.handle.wake_up.remote().result()
        except Exception as e:
            _raise_cause(e)


class HttpClient:
    def __init__(
        self, url: str, model_name: str | None, api_key: str | None, concurrency: int = 8
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600)
        if model_name is None:
            model_name = self.http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        self.model_name = model_name
        self.concurrency = concurrency

    def _one(self, i: int, tokens: list[int], p: SamplingParams) -> RequestOutput:
        body = {"model": self.model_name, "prompt": tokens, "return_token_ids": True}
        body.update(_json_params(p))
        r = self.http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise InvalidRequestError(f"prompt {i}: HTTP {r.status_code}: {_message(r)}")
        data = r.json()
        c = data["choices"][0]
        cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        out = RequestOutput(
            data["id"], tokens, c["token_ids"], c["text"], True, c["finish_reason"], cached
        )
        out.logprobs = _token_logprobs(c.get("logprobs"))
        return out

    def update_weights(self, weights: Any, abort_in_flight: bool = False) -> None:
        """``POST /admin/update_weights`` (an API key with role admin): ``weights`` must be
        a path on the server's filesystem (a ``.safetensors`` file or a model folder)."""
        if not isinstance(weights, str | Path):
            raise InvalidRequestError(
                "over HTTP only a path on the server's filesystem can be sent (a .safetensors "
                f"file or a model folder), not a {type(weights).__name__}; to send tensors, "
                "attach by app name from a process connected to the app's Ray cluster"
            )
        body = {"path": str(weights), "abort_in_flight": abort_in_flight}
        self._admin("update_weights", body)

    def sleep(self, level: int = 1) -> int:
        """``POST /admin/sleep`` (an API key with role admin)."""
        return int(self._admin("sleep", {"level": level})["freed_bytes"])

    def wake_up(self) -> None:
        self._admin("wake_up", {})

    def _admin(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(f"/admin/{route}", json=body)
        if r.status_code != 200:
            raise InvalidRequestError(f"{route}: HTTP {r.status_code}: {_message(r)}")
        return dict(r.json())

    def run(
        self, token_lists: list[list[int]], params: list[SamplingParams], salt: str | None
    ) -> Results:
        if salt is not None:
            raise InvalidRequestError("an attached server salts by API key; pass api_key")
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            futures = {
                pool.submit(self._one, i, t, p): i
                for i, (t, p) in enumerate(zip(token_lists, params, strict=True))
            }
            for f in concurrent.futures.as_completed(futures):
                yield futures[f], f.result()


def _message(r: Any) -> str:
    """An error response's OpenAI-shaped message (else its body)."""
    try:
        return str(r.json()["error"]["message"])
    except Exception:
        return str(r.text)


def ordered(results: Results, n: int) -> list[RequestOutput]:
    outs: list[Any] = [None] * n
    for i, out in results:
        outs[i] = out
    return outs
