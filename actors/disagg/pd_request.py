"""One request of a disaggregated deployment, as its Conductor tracks it across attempts.

An attempt is one (prefill, decode) placement under its own key; a request whose replica
died is placed again from its prompt. Invariant: the caller sees every token once, in
order, over all attempts: a re-run replays the tokens already streamed (seeded sampling
draws the same ones) and ``stream`` passes on only those its ``ledger``
(``actors.engine.stream_ledger``) has not seen. A request with a ``route`` (started by a
Serve ingress) never streams here: its decode replica sends its tokens to that ingress,
whose own ledger drops the replayed ones, and only its end comes here (``finish``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.engine.direct_return import ReturnRoute
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.stream_ledger import StreamLedger
from policies.request import Request


@dataclass
class PDRequest:
    request: Request
    key: str | None = None  # the live attempt's key; None while waiting to be placed
    attempts: int = 0
    prefill_id: str | None = None
    decode_id: str | None = None
    in_prefill: bool = False
    deltas: list[StreamDelta] = field(default_factory=list)
    output: RequestOutput | None = None
    cached_tokens: int = 0
    ledger: StreamLedger = field(default_factory=StreamLedger)  # one choice
    first_token_time: float | None = None  # this process's monotonic clock
    token_times: list[float] = field(default_factory=list)  # when decode produced each
    route: ReturnRoute | None = None  # where its decode replica sends its events

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def start_attempt(self, key: str, prefill_id: str, decode_id: str) -> None:
        self.key, self.prefill_id, self.decode_id = key, prefill_id, decode_id
        self.in_prefill = True
        self.attempts += 1
        self.ledger.begin_replay()

    def drop_attempt(self) -> None:
        self.key = self.prefill_id = self.decode_id = None
        self.in_prefill = False

    def stream(self, delta: StreamDelta, produced_at: float) -> StreamDelta | None:
        """The part of an attempt's ``delta`` the caller has not seen, under the caller's
        request id; None when it is all replay. A delta that straddles the replayed and the
        new tokens is cut (its text goes only with a delta that is all new). The replayed
        tokens are not compared with those sent: the Conductor has no way yet to fail one
        request mid-stream, so a re-run trusts seeded sampling."""
        old = self.ledger.take(0, delta.token_ids, check=False)
        if old == len(delta.token_ids) and not delta.finished:
            return None
        out = StreamDelta(
            self.request_id,
            delta.token_ids[old:],
            delta.text if not old else "",
            delta.finished,
            delta.finish_reason,
            None if delta.logprobs is None else delta.logprobs[old:],
        )
        self.token_times += [produced_at] * len(out.token_ids)
        if self.first_token_time is None and out.token_ids:
            self.first_token_time = time.monotonic()
        self.deltas.append(out)
        return out

    def finish(self, output: RequestOutput) -> None:
        """The decode replica's output, with the caller's id, times on this process's clock
        (the replicas' may differ) and prefix reuse as the prefill side saw it."""
        output.request_id = self.request_id
        # the decode replica's count, from the prefill that admitted it: the prefill's own
        # report (``cached_tokens``) may come after the end
        output.num_cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        output.arrival_time = self.request.arrival_time
        # a routed request's first token passed no stream here: the decode replica's time
        output.first_token_time = self.first_token_time or output.first_token_time
        output.finish_time = time.monotonic()
        self.output, self.key = output, None
        self.in_prefill = False  # the prefill's own report (``PrefillDone``) may come later

    def end(self, text: bool = True) -> None:
        """End it here (aborted, or out of attempts) with the tokens streamed so far."""
        self.output = RequestOutput(
            self.request_id,
            self.request.prompt_token_ids,
            [t for d in self.deltas for t in d.token_ids],
            "".join(d.text for d in self.deltas) if text else "",
            True,
            "abort",
            self.cached_tokens,
            self.request.arrival_time,
            self.first_token_time,
            time.monotonic(),
        )
