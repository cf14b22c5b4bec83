"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Three ways to run, one ``generate``:

- ``LLM(model)``: the engine in this process (``stream`` and ``chat`` too);
- ``LLM(model, num_replicas=k)``: k replica actors on the Ray cluster (``ray.init`` of the
  current job, or a local one), each prompt routed by the cache-aware router;
- ``LLM(model, num_prefill=p, num_decode=d)``: prefill and decode replica actors with KV
  streamed between them (``actors/disagg/cluster.py``);
- ``LLM.attach("app-name" | "http://host:port")``: a running Serve app.

Every prompt of a call is validated before any starts, so a bad prompt fails the call
cleanly and leaves nothing running.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from actors.engine.config import EngineConfig
from actors.engine.defaults import BATCH_MAX_IN_FLIGHT
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from errors import InvalidRequestError

Prompts = str | Sequence[str] | None
TokenPrompts = Sequence[int] | Sequence[Sequence[int]] | None
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        num_replicas: int | None = None,
        *,
        routing: str = "prefix_aware",
        num_cpus: float = 0.0,
        max_in_flight: int = BATCH_MAX_IN_FLIGHT,
        num_prefill: int | None = None,
        num_decode: int | None = None,
        **engine_options: Any,
    ) -> None:
        """``num_replicas=None``: in this process. Otherwise replica actors with
        ``num_cpus`` each, routed by the ``routing`` policy (see actors/serving/router_state.py),
        at most ``max_in_flight`` requests submitted at once. ``num_prefill`` /
        ``num_decode``: a disaggregated deployment instead (Conductor placement)."""
        self.remote: Any = None
        if num_prefill is not None or num_decode is not None:
            if num_replicas is not None:
                raise InvalidRequestError("give num_replicas or num_prefill/num_decode, not both")
            from actors.disagg.cluster import PDCluster
            from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig

            config = PDClusterConfig(
                None if model is None else str(model),
                EngineConfig.from_options(**engine_options),
                prefill=PDSideConfig(num_prefill or 1),
                decode=PDSideConfig(num_decode or 1),
            )
            self.remote = _Disaggregated(PDCluster(config))
            self.tokenizer = self.remote.cluster.tokenizer
            return
        if num_replicas is None:
            self.engine = ReplicaController.build(model, **engine_options)
            self.builder = self.engine.request_builder()
            self.tokenizer = self.engine.tokenizer
            return
        from actors.serving.client import ReplicaPool

        self.remote = ReplicaPool(
            None if model is None else str(model),
            num_replicas,
            routing,
            num_cpus,
            EngineConfig.from_options(**engine_options),
            max_in_flight,
        )
        self.tokenizer = _load_tokenizer(model)

    @classmethod
    def attach(
        cls,
        target: str,
        *,
        api_key: str | None = None,
        model: str | Path | None = None,
        model_name: str | None = None,
    ) -> LLM:
        """Attach to a running Serve app: by app name (this process must be connected to its
        Ray cluster) or by URL. ``model`` is the folder whose tokenizer encodes prompts here
        (default: the built-in tiny model); ``api_key`` selects the tenant."""
        from actors.serving.client import HttpClient, ServeAppClient

        self = cls.__new__(cls)
        if target.startswith(("http://", "https://")):
            self.remote = HttpClient(target, model_name, api_key)
        else:
            self.remote = ServeAppClient(target, api_key)
        self.tokenizer = _load_tokenizer(model)
        return self

    def close(self) -> None:
        """Stop the replica actors this LLM started (no-op in process or attached)."""
        if self.remote is not None and hasattr(self.remote, "shutdown"):
            self.remote.shutdown()

    # -- weights and memory between rollout phases ------------------------------------------
    def update_weights(self, weights: Any, *, abort_in_flight: bool = False) -> None:
        """Load new weights in place, with no restart: ``weights`` maps Hugging Face tensor
        names to tensors (all of the model's or some), or is a path to a ``.safetensors``
        file or a model folder, or a Ray object ref to either. A tensor the model lacks, of
        another shape, or not floating-point is refused (InvalidRequestError) before
        anything changes. Requests in flight finish on the old weights (or, with
        ``abort_in_flight``, are aborted and run again on the new ones); KV computed with
        the old weights is never reused. In process, call it between ``generate`` calls.
        Attached to a Serve app by name, every replica of every group loads it; by URL,
        ``weights`` must be a path on the server and ``api_key`` an admin key."""
        if self.remote is None:
            self.engine.update_weights(weights)
            return
        self._remote_call("update_weights", weights, abort_in_flight)

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), or the KV cache and the weights (level 2), once the
        requests in flight finish; requests sent while asleep wait for ``wake_up`` (in
        process and on a P/D deployment they are refused until then: a call's ``generate``
        holds no request when it returns). Returns the bytes freed (every replica's)."""
        if self.remote is None:
            return self.engine.sleep(level)
        return int(self._remote_call("sleep", level))

    def wake_up(self) -> None:
        """Restore what ``sleep`` freed (the weights as last updated; an empty KV cache)."""
        if self.remote is None:
            self.engine.wake_up()
            return
        self._remote_call("wake_up")

    def _remote_call(self, method: str, *args: Any) -> Any:
        call = getattr(self.remote, method, None)
        if call is None:
            raise InvalidRequestError(
                f"{method} is built for LLM in process, LLM(num_replicas=k), "
                f"LLM(num_prefill=..., num_decode=...) and LLM.attach(app or URL); not for "
                f"{type(self.remote).__name__}"
            )
        return call(*args)

    def generate(
        self,
        prompts: Prompts = None,
        sampling_params: Params = None,
        *,
        prompt_token_ids: TokenPrompts = None,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Greedy when ``temperature == 0``."""
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        if self.remote is not None:
            outs: list[Any] = [None] * len(token_lists)
            for i, out in self.remote.run(token_lists, params, salt):
                outs[i] = out
            return outs
        requests = self.builder.build_each(token_lists, params, salt=salt)
        ids = [self.engine.add_request(r) for r in requests]
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [self.engine.release(rid) for rid in ids]

    def generate_unordered(
        self,
        prompts: Prompts = None,
        sampling_params: Params = None,
        *,
        prompt_token_ids: TokenPrompts = None,
        salt: str | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """``(index, output)`` pairs as requests finish (each index once): rollouts write
        results as they come. In process, the whole batch runs first."""
        token_lists = self._token_lists(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        if self.remote is not None:
            yield from self.remote.run(token_lists, params, salt)
            return
        outs = self.generate(prompt_token_ids=token_lists, sampling_params=params, salt=salt)
        yield from enumerate(outs)

    def stream(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield this request's tokens as they are produced; the last delta has finished=True.

        Closing the iterator early aborts the request and frees its blocks.
        """
        if self.remote is not None:
            raise InvalidRequestError(
                "stream runs in process only; stream from a Serve app over HTTP (stream=true)"
            )
        if prompt is not None and prompt_token_ids is not None:
            raise InvalidRequestError("give either prompt or prompt_token_ids, not both")
        (ids,) = self._token_lists(prompt, [prompt_token_ids] if prompt_token_ids else None)
        request = self.builder.build(ids, sampling_params or SamplingParams(), salt=salt)
        rid = self.engine.add_request(request)
        sent_tokens, sent_text = 0, 0
        try:
            while True:
                self.engine.step()
                out = self.engine.output(rid)
                if len(out.token_ids) > sent_tokens or out.finished:
                    yield StreamDelta(
                        rid,
                        out.token_ids[sent_tokens:],
                        out.text[sent_text:],
                        out.finished,
                        out.finish_reason,
                        None if out.logprobs is None else out.logprobs[sent_tokens:],
                    )
                    sent_tokens, sent_text = len(out.token_ids), len(out.text)
                if out.finished:
                    return
        finally:
            if not self.engine.output(rid).finished:
                self.engine.abort(rid)
            self.engine.release(rid)

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        """Apply the model's chat template and generate one reply."""
        if not messages:
            raise InvalidRequestError("messages is empty; send at least one message")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(prompt_token_ids=[ids], sampling_params=sampling_params)[0]

    # -- input normalisation ----------------------------------------------------------------
    def _token_lists(self, prompts: Prompts, prompt_token_ids: TokenPrompts) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not texts:
                raise InvalidRequestError("prompts is empty; send at least one prompt")
            for i, t in enumerate(texts):
                if not isinstance(t, str) or not t:
                    raise InvalidRequestError(f"prompt {i} is empty or not a string")
            return [self.tokenizer.encode(t) for t in texts]
        assert prompt_token_ids is not None
        seqs = list(prompt_token_ids)
        if not seqs:
            raise InvalidRequestError("prompt_token_ids is empty; send at least one token")
        if all(isinstance(t, int) for t in seqs):
            return [list(seqs)]  # type: ignore[arg-type]
        out = []
        for i, s in enumerate(seqs):
            if isinstance(s, int | str | bytes) or not hasattr(s, "__iter__"):
                raise InvalidRequestError(f"prompt_token_ids[{i}] must be a list of token ids")
            out.append(list(s))
        return out

    @staticmethod
    def _params(sampling_params: Params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts")
        return params


def _load_tokenizer(model: str | Path | None) -> Any:
    from models import load_tokenizer, tiny_model_dir

    return load_tokenizer(Path(model) if model is not None else tiny_model_dir("dense"))


class _Disaggregated:
    """``LLM``'s remote backend over a ``PDCluster``."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def run(
        self, token_lists: list[list[int]], params: list[SamplingParams], salt: str | None
    ) -> Iterator[tuple[int, RequestOutput]]:
        outs = self.cluster.generate(
            prompt_token_ids=token_lists, sampling_params=list(params), salt=salt
        )
        yield from enumerate(outs)

    def update_weights(self, weights: Any, abort_in_flight: bool = False) -> None:
        self.cluster.update_weights(weights)  # nothing is in flight between calls here

    def sleep(self, level: int = 1) -> int:
        return int(self.cluster.sleep(level))

    def wake_up(self) -> None:
        self.cluster.wake_up()

    def shutdown(self) -> None:
        self.cluster.shutdown()
