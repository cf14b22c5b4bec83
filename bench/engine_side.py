"""The engines alone, as a side of the chat bench: what the served app would reach if its
serving path cost nothing.

``EngineSide(model, n)`` spawns ``n`` processes, each with one in-process engine
(``actors.LLM(model)``, the engine's defaults, as a plain config's replica has them) pinned
to its own run of this machine's cores (``disjoint_cores``, as the Serve app pins its
colocated replicas on one node) with as many torch threads as cores. Its ``conversation``
has ``ChatClient.conversation``'s contract: each turn goes to the process with the fewest
open requests (ties: the lowest index), which renders the messages with the model's chat
template, adds the request at the next step boundary and steps its engine until the
request ends. Times are ``time.perf_counter`` in both processes (CLOCK_MONOTONIC on Linux,
one clock for the machine): TTFT from the parent's send to the end of the step that made
the first token, ITLs between the steps that made tokens. No HTTP, no Ray, no Serve, no
router: served req/s over this side's is the share of the engines' own pace the serving
path keeps.

A process that fails or exits fails its open requests' turns (RuntimeError) and every later
turn sent to it; none waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import threading
import time
from itertools import pairwise
from typing import Any

from bench.child_process import expect, guarded
from bench.serve_chat import Conversation, converse
from bench.serve_records import Sample


def _engine_process(conn: Any, model: str, cores: list[int]) -> None:
    import torch

    from actors import LLM, SamplingParams

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    llm = LLM(model)
    tok, engine = llm.tokenizer, llm.engine
    conn.send(("ready",))
    live: dict[str, tuple[int, int, list[float]]] = {}  # request id -> (tag, prompt, times)
    while True:
        while conn.poll(None if not live else 0):  # block only while nothing runs
            msg = conn.recv()
            if msg[0] == "stop":
                return
            tag, messages, max_tokens, ignore_eos = msg[1:]
            ids = list(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
            live[engine.add_request(llm.builder.build(ids, params))] = (tag, len(ids), [])
        engine.step()
        now = time.perf_counter()
        for rid, (tag, prompt, times) in list(live.items()):
            out = engine.output(rid)
            times.extend([now] * (len(out.token_ids) - len(times)))
            if out.finished:
                engine.release(rid)
                del live[rid]
                conn.send(("done", tag, prompt, times, tok.decode(list(out.token_ids))))


class EngineSide:
    def __init__(self, model: str, processes: int) -> None:
        from actors.engine.replica_loop import disjoint_cores

        runs = disjoint_cores(processes)
        if not runs:
            raise ValueError(f"{processes} engine processes need at least as many cores")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for cores in runs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=guarded, args=(_engine_process, child, model, cores))
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for conn, proc in zip(self._conns, self._procs, strict=True):
            expect(conn, "ready", proc)
        self._open = [0] * processes
        # tag -> (the process running it, its result)
        self._waiting: dict[int, tuple[int, asyncio.Future[tuple[Any, ...]]]] = {}
        self._next_tag = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers = [
            threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(processes)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        """Resolve each finished request's future on the event loop. When process ``i``
        fails or exits, its open requests' futures raise instead of waiting forever."""
        conn = self._conns[i]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("error", f"exit code {self._procs[i].exitcode}")
            if msg[0] == "error":
                self._fail(i, RuntimeError(f"engine process {i} failed: {msg[1]}"))
                return
            _, fut = self._waiting.pop(msg[1])
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fut.set_result, msg[2:])

    def _fail(self, i: int, error: BaseException) -> None:
        for tag, (owner, fut) in list(self._waiting.items()):
            if owner == i:
                del self._waiting[tag]
                assert self._loop is not None
                self._loop.call_soon_threadsafe(fut.set_exception, error)

    async def turn(
        self, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool, turn: int
    ) -> tuple[Sample, str]:
        self._loop = asyncio.get_running_loop()
        i = min(range(len(self._open)), key=lambda k: (self._open[k], k))
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        fut: asyncio.Future[tuple[Any, ...]] = self._loop.create_future()
        self._waiting[tag] = (i, fut)
        self._open[i] += 1
        sent = time.perf_counter()
        try:
            if not self._readers[i].is_alive():  # its process ended: nothing would answer
                raise OSError("its reader ended")
            self._conns[i].send(("start", tag, list(messages), max_tokens, ignore_eos))
            prompt, times, text = await fut
        except OSError as e:
            self._waiting.pop(tag, None)
            code = self._procs[i].exitcode
            raise RuntimeError(f"engine process {i} is gone (exit code {code}): {e}") from e
        finally:
            self._open[i] -= 1
        end = times[-1] if times else time.perf_counter()
        first = times[0] if times else end
        itls = [b - a for a, b in pairwise(times)]
        sample = Sample(first - sent, end - sent, itls, len(times), turn=turn, prompt_tokens=prompt)
        return sample, text

    async def conversation(self, conv: Conversation) -> list[Sample]:
        return await converse(self.turn, conv)

    async def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a process that already ended
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
