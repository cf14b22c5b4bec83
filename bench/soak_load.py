"""The soak's load (``bench/soak.py``): closed-loop HTTP clients sending greedy requests
whose tokens are known, each request's outcome classified (ok, retriable, dropped, lost,
wrong) and tallied per fault window."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.soak_app import MAX_TOKENS, MODEL, USER_KEY
from bench.sse import StreamCut, StreamError, sse_json

REQUEST_TIMEOUT_S = 90.0
RETRY_FOR_S = 300.0  # a client retries a request for this long (longer than a recovery)


def client(url: str, timeout: float, key: str = USER_KEY) -> httpx.Client:
    """An HTTP client of the app sending ``key`` (ignored by an app without API keys)."""
    return httpx.Client(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"})


@dataclass
class Tally:
    ok: int = 0
    retriable: int = 0
    dropped: int = 0
    lost: int = 0
    wrong: int = 0
    gave_up: int = 0  # requests whose every try within RETRY_FOR_S was retriable or dropped
    why: Counter[str] = field(default_factory=Counter)


def one_request(
    http: httpx.Client, prompt: list[int], want: list[int], stream: bool
) -> tuple[str, str]:
    """(outcome, why): outcome in ok / retriable / lost / wrong."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    try:
        if not stream:
            r = http.post("/v1/completions", json=body)
            return classify_whole(r, want)
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return classify_whole(r, want)
            got: list[int] = []
            try:
                for chunk in sse_json(r.iter_lines()):
                    for c in chunk.get("choices", []):
                        got += c.get("token_ids") or []
            except StreamError as e:
                if got != want[: len(got)]:
                    return "wrong", f"streamed {got} before the error; want {want}"
                return "retriable", f"stream error: {e.message[:80]}"
            except StreamCut as e:
                if got != want[: len(got)]:
                    return "wrong", f"streamed {got}; want {want}"
                return "lost", str(e)
            return ("ok", "") if got == want else ("wrong", f"{got} != {want}")
    except httpx.TimeoutException:
        return "lost", "timed out"
    except httpx.HTTPError as e:  # the connection broke: the client sees the failure
        return "dropped", f"connection broke: {type(e).__name__}"


def classify_whole(r: httpx.Response, want: list[int]) -> tuple[str, str]:
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code == 200 and isinstance(body, dict):
        got = body["choices"][0].get("token_ids")
        return ("ok", "") if got == want else ("wrong", f"{got} != {want}")
    error = body.get("error") if isinstance(body, dict) else None
    if r.status_code in (429, 503) and isinstance(error, dict) and error.get("message"):
        return "retriable", f"{r.status_code}: {error['message'][:80]}"
    if r.status_code >= 500:  # an error, but not ours: the Serve proxy's
        return "dropped", f"{r.status_code}: {r.text[:80]!r}"
    return "lost", f"{r.status_code}: {r.text[:80]!r}"


@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    outcome: str  # ok / retriable / dropped / lost / wrong
    why: str
    final: bool = True  # the request's last try (no retry follows it)


class Load:
    """``clients`` closed-loop clients, each recording every request's ``Outcome``. A
    client sends a request again (backing off) after a retriable or dropped try, until it
    ends otherwise or ``RETRY_FOR_S`` passed since its first try; it finishes the request
    it is on when the load stops."""

    def __init__(
        self, url: str, cases: list[tuple[list[int], list[int]]], clients: int, seed: int
    ) -> None:
        self.url = url
        self.cases = cases
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a request started or ended
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self.threads = [
            threading.Thread(target=self._client, args=(seed + i,), daemon=True)
            for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(RETRY_FOR_S + REQUEST_TIMEOUT_S)

    def wait_ended(self, n: int, timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """Until ``n`` more requests ended (whatever their outcome); False on timeout."""
        with self.changed:
            target = len(self.outcomes) + n
            return self.changed.wait_for(lambda: len(self.outcomes) >= target, timeout)

    def count_in_flight(self) -> int:
        with self.lock:
            return self.in_flight

    def wait_busy(self, timeout: float = REQUEST_TIMEOUT_S) -> bool:
        """Until a request is in flight; False on timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: self.in_flight > 0, timeout)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with client(self.url, REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                prompt, want = rng.choice(self.cases)
                stream = rng.random() < 0.5
                first, backoff = time.monotonic(), 0.2
                while True:
                    outcome = self._try(http, prompt, want, stream, first + RETRY_FOR_S)
                    if outcome.final:
                        break
                    time.sleep(backoff)  # as a client backing off before a retry
                    backoff = min(2 * backoff, 2.0)

    def _try(
        self, http: httpx.Client, prompt: list[int], want: list[int], stream: bool, until: float
    ) -> Outcome:
        with self.changed:
            self.in_flight += 1
            self.changed.notify_all()
        start = time.monotonic()
        try:
            outcome, why = one_request(http, prompt, want, stream)
        except Exception as e:  # a malformed answer: counted, never a dead client
            outcome, why = "lost", f"{type(e).__name__}: {str(e)[:80]}"
        end = time.monotonic()
        final = outcome not in ("retriable", "dropped") or end >= until
        result = Outcome(start, end, outcome, why, final)
        with self.changed:
            self.in_flight -= 1
            self.outcomes.append(result)
            self.changed.notify_all()
        return result


def tally(outcomes: list[Outcome], windows: list[tuple[str, float, float]]) -> dict[str, Tally]:
    """Per fault kind: the requests that overlapped one of its windows (kill .. full
    strength again), each under the last fault before it ended; the rest under ``none``."""
    out: dict[str, Tally] = {}
    for o in outcomes:
        hit = [(a, k) for k, a, b in windows if o.start <= b and o.end >= a]
        kind = max(hit)[1] if hit else "none"
        t = out.setdefault(kind, Tally())
        setattr(t, o.outcome, getattr(t, o.outcome) + 1)
        if o.outcome != "ok":
            t.why[f"{o.outcome}: {o.why}"] += 1
        if o.final and o.outcome in ("retriable", "dropped"):
            t.gave_up += 1
    return out
