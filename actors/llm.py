"""The Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Runs the engine in this process. Every prompt of a call is validated before any starts, so a
bad prompt fails the call cleanly and leaves nothing running.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from actors.replica_controller import ReplicaController
from actors.outputs import RequestOutput, StreamDelta
from actors.sampling import SamplingParams
from errors import InvalidRequestError

Prompts = str | Sequence[str] | None
TokenPrompts = Sequence[int] | Sequence[Sequence[int]] | None
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_options) -> None:
        self.engine = ReplicaController(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

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
        for i, (tokens, p) in enumerate(zip(token_lists, params, strict=True)):
            try:
                self.engine.validate(tokens, p)
            except InvalidRequestError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        pairs = zip(token_lists, params, strict=True)
        ids = [self.engine.add_request(t, p, salt=salt) for t, p in pairs]
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [self.engine.release(rid) for rid in ids]

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
        if prompt is not None and prompt_token_ids is not None:
            raise InvalidRequestError("give either prompt or prompt_token_ids, not both")
        (ids,) = self._token_lists(prompt, [prompt_token_ids] if prompt_token_ids else None)
        rid = self.engine.add_request(ids, sampling_params or SamplingParams(), salt=salt)
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
