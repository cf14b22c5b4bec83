"""The chat bench's engines-alone side (``bench.engine_side``): a conversation's turns run on
a spawned process's in-process engine, the second turn carrying the first's answer, with
the same greedy tokens as the engine in this process, and timings a sample can hold."""

from __future__ import annotations

import asyncio

import pytest

from actors import LLM, SamplingParams
from bench.engine_side import EngineSide
from bench.serve_chat import Conversation
from models.tiny import tiny_model_dir


def test_a_conversation_runs_on_the_engine_process_as_on_the_engine_here():
    model = str(tiny_model_dir())
    conv = Conversation(("hello there", "and again"), (6, 4), True)

    async def run() -> tuple[list, list, str]:
        side = EngineSide(model, 1)
        try:
            _, text = await side.turn([{"role": "user", "content": "hello there"}], 6, True, 1)
            return await side.conversation(conv), await side.conversation(conv), text
        finally:
            await side.close()

    first, again, answer = asyncio.run(run())
    assert [s.turn for s in first] == [1, 2]
    assert [s.output_tokens for s in first] == [6, 4]  # ignore_eos: every asked token
    for s in first:
        assert 0 < s.ttft <= s.e2e
        assert len(s.itls) == s.output_tokens - 1 and min(s.itls) >= 0
    # the second turn's prompt holds the first turn's prompt and answer
    assert first[1].prompt_tokens > first[0].prompt_tokens + 6
    assert [s.prompt_tokens for s in again] == [s.prompt_tokens for s in first]

    llm = LLM(model)
    tok = llm.tokenizer
    ids = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hello there"}]),
        add_special_tokens=False,
    )
    here = llm.generate(
        prompt_token_ids=[list(ids)],
        sampling_params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )[0]
    assert first[0].prompt_tokens == len(ids)
    assert answer and answer == tok.decode(list(here.token_ids))


def test_a_request_on_an_engine_process_that_dies_raises_instead_of_waiting():
    async def run() -> None:
        side = EngineSide(str(tiny_model_dir()), 1)
        try:
            ask = asyncio.ensure_future(
                side.turn([{"role": "user", "content": "hi"}], 1500, True, 1)
            )
            await asyncio.sleep(0)  # sent
            side._procs[0].kill()
            with pytest.raises(RuntimeError, match="engine process 0 failed: exit code"):
                await asyncio.wait_for(ask, 60)  # a bound on a hang, not a timing
            with pytest.raises(RuntimeError, match="is gone"):
                await side.turn([{"role": "user", "content": "hi"}], 4, True, 1)
        finally:
            await side.close()

    asyncio.run(run())
