"""``overlap_steps``: the next step planned and submitted before this one's tokens are read,
its decodes fed the sampled tokens on the device (actors/engine/token_feed.py).

On CPU the worker runs each step as it is submitted, so nothing overlaps in time here; what
these tests pin is that the overlapped order gives exactly the tokens, texts and finish
reasons of the one-step-at-a-time engine, through every way a request ends, and that the
step ahead really ran on placeholders fed by the worker.
"""

from __future__ import annotations

import random

import pytest
import torch

from actors import LLM, SamplingParams
from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from actors.engine.step_plan import DeviceTokens, PlanEntry
from actors.engine.token_feed import feed, feed_sources
from actors.engine.worker_hooks import WorkerHooks
from models import tiny_model_dir
from policies.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig
from policies.sequence import FinishReason, Sequence
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager

BS = 4


def _entry(rid: str, tokens: list[int]) -> PlanEntry:
    return PlanEntry(rid, 10, tokens, [(0, 0, [0, 1, 2, 3])], None)


def test_feed_replaces_placeholders_with_the_kept_rows():
    kept = DeviceTokens(["a", "b", "c"], torch.tensor([70, 80, 90]))
    entries = [_entry("x", [5, 6, 7]), _entry("c", [PLACEHOLDER]), _entry("a", [PLACEHOLDER])]
    sources = feed_sources(entries, kept)
    assert sources == [-1, -1, -1, 2, 0]
    ids = torch.tensor([5, 6, 7, PLACEHOLDER, PLACEHOLDER])
    assert feed(ids, sources, kept).tolist() == [5, 6, 7, 90, 70]
    assert feed_sources([_entry("x", [1, 2])], None) is None  # nothing to feed


def test_feed_refuses_a_token_it_does_not_hold():
    with pytest.raises(ValueError, match="kept no tokens"):
        feed_sources([_entry("a", [PLACEHOLDER])], None)
    with pytest.raises(ValueError, match="did not sample one for it"):
        feed_sources([_entry("z", [PLACEHOLDER])], DeviceTokens(["a"], torch.tensor([1])))


def test_advance_then_settle_is_update():
    kv = KVCacheManager(BlockPool(16, BS), True)
    sched = Scheduler(SchedulerConfig(token_budget=64), kv)
    stop = Sequence("s", [1, 2, 3], max_tokens=2, stop_token_ids=frozenset({9}))
    last = Sequence("l", [4, 5], max_tokens=1, stop_token_ids=frozenset({9}))
    for s in (stop, last):
        sched.add(s)
    step = sched.schedule(0.0)
    advanced = sched.advance(step, 1.0)
    assert advanced == [stop, last]
    assert stop.output_token_ids == [PLACEHOLDER] and stop.token_ids[-1] == PLACEHOLDER
    assert last.finish_reason is FinishReason.LENGTH  # its last allowed token, value unknown
    sched.settle(advanced, {"s": 7, "l": 9}, 2.0)
    assert stop.token_ids == [1, 2, 3, 7] and not stop.is_finished
    assert last.output_token_ids == [9] and last.finish_reason is FinishReason.STOP
    assert stop.first_token_time == 2.0
    step = sched.schedule(3.0)
    assert step.entries == [(stop, 1)] and step.starts == [3]
    sched.settle(sched.advance(step, 4.0), {"s": 9}, 5.0)
    assert stop.finish_reason is FinishReason.STOP and kv.num_used_blocks == 0
    # aborted between advance and settle: its token is written in, it stays an abort
    late = Sequence("a", [6, 7], max_tokens=4, stop_token_ids=frozenset({9}))
    sched.add(late)
    advanced = sched.advance(sched.schedule(6.0), 7.0)
    sched.finish("a", FinishReason.ABORT, 7.5)
    sched.settle(advanced, {"a": 9}, 8.0)
    assert late.output_token_ids == [9] and late.finish_reason is FinishReason.ABORT


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _engine(overlap: bool, **options) -> ReplicaController:
    options = {"dtype": torch.float32, "block_size": BS, "num_blocks": 64, **options}
    return ReplicaController.build(tiny_model_dir("dense"), overlap_steps=overlap, **options)


def _run(engine: ReplicaController, prompts, params, arrivals=None, abort=None):
    """Every request to its end; requests join at the step ``arrivals`` gives (default 0);
    ``abort``: (request index, tokens), aborted once it streamed that many. Returns the final
    outputs, the deltas each request streamed, and how many plans were fed placeholders."""
    builder = engine.request_builder()
    fed = []
    submit = engine.executor.submit

    def spy(plan):
        fed.append(any(PLACEHOLDER in e.token_ids for e in plan.entries))
        return submit(plan)

    engine.executor.submit = spy  # type: ignore[method-assign]
    arrivals = arrivals or [0] * len(prompts)
    ids: list[str | None] = [None] * len(prompts)
    streamed: dict[str, list] = {}
    step = 0
    while any(i is None for i in ids) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if ids[i] is None and at <= step:
                ids[i] = engine.add_request(builder.build(prompts[i], params[i]))
        if abort is not None and ids[abort[0]] is not None:
            rid = ids[abort[0]]
            if sum(len(d.token_ids) for d in streamed.get(rid, [])) >= abort[1]:
                engine.abort(rid)
                abort = None
        for d in engine.step():
            streamed.setdefault(d.request_id, []).append(d)
        step += 1
    outs = [engine.release(rid) for rid in ids]
    assert engine.kv.num_used_blocks == 0
    return outs, [streamed.get(rid, []) for rid in ids], sum(fed)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert x.logprobs == y.logprobs


@pytest.mark.parametrize("graphs", [False, True])
def test_overlapped_steps_give_the_serial_engines_outputs(graphs):
    prompts = _prompts(3, (5, 9, 13, 3, 17, 6))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    serial, _, _ = _run(_engine(False, cuda_graphs=graphs), prompts, [greedy] * 6)
    # stop tokens and stop strings that end requests mid-stream, as the serial run saw them
    stop_token = serial[1].token_ids[4]
    text = serial[2].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 2]
    params = [
        greedy,
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_string], ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, min_tokens=3, ignore_eos=True),
    ]
    arrivals = [0, 0, 2, 3, 5, 6]
    want, want_streams, _ = _run(_engine(False, cuda_graphs=graphs), prompts, params, arrivals)
    got, streams, fed = _run(_engine(True, cuda_graphs=graphs), prompts, params, arrivals)
    _same(want, got)
    assert want[1].finish_reason == "stop" and want[2].finish_reason == "stop"
    assert stop_string not in want[2].text and len(want[2].token_ids) < 12
    for a, b in zip(want_streams, streams, strict=True):  # the same deltas, none after the end
        assert [(d.token_ids, d.text, d.finished) for d in a] == [
            (d.token_ids, d.text, d.finished) for d in b
        ]
    assert fed > 5  # steps ran ahead on tokens the worker fed


def test_a_penalized_request_runs_its_steps_one_at_a_time():
    prompts = _prompts(4, (6, 10))
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5, ignore_eos=True),
    ]
    want, _, _ = _run(_engine(False), prompts, params)
    got, _, fed = _run(_engine(True), prompts, params)
    _same(want, got)
    assert fed == 0  # its next spec needs its newest token's value: nothing ran ahead


def test_abort_and_a_full_kv_pool_while_a_step_runs_ahead():
    # 12 KV blocks (11 pooled beside the scratch block): two requests fit at a time, the
    # others wait for blocks that requests finishing in the step's settle free; one request
    # is aborted after its third token, while the step ahead holds it
    prompts = _prompts(5, (9, 14, 6, 11))
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4
    options = {"num_blocks": 12, "cuda_graphs": True}
    want, _, _ = _run(_engine(False, **options), prompts, params, abort=(2, 3))
    engine = _engine(True, **options)
    got, streams, fed = _run(engine, prompts, params, abort=(2, 3))
    _same(want, got)
    assert got[2].finish_reason == "abort" and 3 <= len(got[2].token_ids) < 10
    assert sum(len(d.token_ids) for d in streams[2]) == len(got[2].token_ids)
    assert fed > 0 and engine.kv.num_free_blocks == 11


def test_prefix_cache_hits_after_overlapped_steps():
    prompt = _prompts(6, (16,))[0]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_model_dir("dense"), dtype=torch.float32, block_size=BS, overlap_steps=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    again = prompt + first.token_ids  # the generated blocks were committed with real tokens
    second = llm.generate(prompt_token_ids=[again], sampling_params=params)[0]
    # every full block of the first request's computed tokens is found: 24 of 25 tokens
    assert second.num_cached_tokens == (len(again) - 1) // BS * BS == 24
    serial = LLM(tiny_model_dir("dense"), dtype=torch.float32, block_size=BS)
    assert serial.generate(prompt_token_ids=[again], sampling_params=params)[0].token_ids == (
        second.token_ids
    )


def test_overlap_steps_refuses_layouts_it_cannot_feed():
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(overlap_steps=True, kvp=2)
    with pytest.raises(ValueError, match="no worker hooks"):
        ReplicaController.build(
            tiny_model_dir("dense"), overlap_steps=True, worker_hooks=WorkerHooks()
        )


def test_no_step_is_left_pending_once_every_request_ended():
    # a stream that ends on a stop string, or is closed early, leaves the step ahead
    # holding only ended requests: it is completed and dropped, nothing stays pending
    llm = LLM(tiny_model_dir("dense"), dtype=torch.float32, block_size=BS, overlap_steps=True)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = _prompts(8, (7,))[0]
    text = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].text
    stop = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[text[4:6]])
    deltas = list(llm.stream(prompt_token_ids=prompt, sampling_params=stop))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == text[: text.find(text[4:6])]
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_used_blocks == 0
    stream = llm.stream(prompt_token_ids=prompt, sampling_params=greedy)
    next(stream), next(stream)
    stream.close()  # aborted while the step ahead holds it
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_used_blocks == 0
