"""Every parallel layout on a local Ray cluster gives the single-process engine's tokens.

Layouts are {tp 1, 2} x {spp 1, 2, 3} x {kvp 1, 2} over the tiny model (4 layers, 4 query
and 2 KV heads) in float64, so an argmax tie cannot flip between summation orders. One
prompt is long enough to spill across KV-parallel ranks: with 48 tokens per rank and
20-token chunks, the shard boundary falls inside a prefill chunk (tokens 40..59).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors.engine.replica_controller import ReplicaController  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from models.tiny import tiny_model_dir  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (5, 37, 70)]
LONG = 2  # index of the prompt that spans KV ranks
OPTIONS = dict(dtype=torch.float64, chunk_size=20, num_blocks=64, kvp_rank_tokens=48)
MAX_TOKENS = 8
# One plain greedy prompt; one with penalties, a logit bias and raw logprobs; one seeded,
# with min_tokens and processed logprobs: the worker that samples (last stage, TP rank 0,
# the compute rank of a KV-split request) gets each request's history through the plan.
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
    SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        logit_bias={7: 2.0},
        logprobs=2,
        ignore_eos=True,
    ),
    SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=11,
        frequency_penalty=0.7,
        min_tokens=MAX_TOKENS,
        logprobs=3,
        logprobs_mode="processed",
    ),
]


@pytest.fixture(scope="module")
def cluster():
    ray.init("local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def generate(
    controller: ReplicaController,
    watch=None,
    prompts=PROMPTS,
    max_tokens=MAX_TOKENS,
    logprobs: list | None = None,
) -> list[list[int]]:
    """Token ids per prompt (``PARAMS`` for ``PROMPTS``, else greedy); ``logprobs``
    collects each request's logprobs."""
    plain = SamplingParams(max_tokens=max_tokens, temperature=0)
    params = PARAMS if prompts is PROMPTS else [plain] * len(prompts)
    builder = controller.request_builder()
    ids = [
        controller.add_request(builder.build(t, p)) for t, p in zip(prompts, params, strict=True)
    ]
    while controller.has_unfinished():
        controller.step()
        if watch is not None:
            watch(controller, ids)
    outs = [controller.release(rid) for rid in ids]
    if logprobs is not None:
        logprobs.extend(o.logprobs for o in outs)
    return [o.token_ids for o in outs]


def assert_logprobs_close(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        for a, b in zip(g or [], w or [], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, rel=1e-6, abs=1e-9)


REFERENCE_LOGPROBS: list = []


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    controller = ReplicaController.build(tiny_model_dir("dense"), **OPTIONS)
    tokens = generate(controller, logprobs=REFERENCE_LOGPROBS)
    controller.shutdown()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert REFERENCE_LOGPROBS[1] and len(REFERENCE_LOGPROBS[2][0].top) == 3
    return tokens


# A pairwise covering of tp {1, 2} x spp {1, 2, 3} x kvp {1, 2}: each value of each pair of
# dimensions meets each value of the other in some layout, the largest (2, 3, 2) among them;
# (1, 1, 1) is the reference itself.
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 3, 1), (2, 3, 2)]


@pytest.mark.parametrize(("tp", "spp", "kvp"), LAYOUTS, ids=lambda v: str(v))
def test_layout_matches_single_process(cluster, reference, tp, spp, kvp):
    controller = ReplicaController.build(
        tiny_model_dir("dense"), tp=tp, spp=spp, kvp=kvp, **OPTIONS
    )
    shard_starts: set[int] = set()

    def watch(c, ids):
        shards = c.kv.shards(ids[LONG])
        shard_starts.update(first for _, first, _ in shards)

    logprobs: list = []
    try:
        tokens = generate(controller, watch, logprobs=logprobs)
    finally:
        controller.shutdown()
    assert tokens == reference
    assert_logprobs_close(logprobs, REFERENCE_LOGPROBS)
    if kvp == 2:
        assert shard_starts == {0, 48}, "the long prompt must spill onto the second rank"
        assert 48 % OPTIONS["chunk_size"] != 0  # so the boundary falls inside a chunk
    assert controller.kv.check_blocks() == [0] * controller.kv.kvp


def test_tensor_parallel_beyond_kv_heads_matches_single_process(cluster):
    """tp=2 on a one-KV-head model: each rank holds a replica of the KV head."""
    model_dir = tiny_model_dir("dense", num_key_value_heads=1)
    options = dict(dtype=torch.float64, chunk_size=20, num_blocks=16)
    outputs = []
    for tp in (1, 2):
        controller = ReplicaController.build(model_dir, tp=tp, **options)
        try:
            outputs.append(generate(controller, prompts=PROMPTS[:2], max_tokens=4))
        finally:
            controller.shutdown()
    reference, sharded = outputs
    assert all(len(t) == 4 for t in reference)
    assert sharded == reference


def test_sequence_pipeline_overlaps_prefill_chunks(cluster):
    """Chunk k+1 starts on stage 0 before chunk k leaves the last stage."""
    controller = ReplicaController.build(
        tiny_model_dir("dense"), spp=3, dtype=torch.float64, chunk_size=16, num_blocks=64
    )
    controller.record_timings = True
    try:
        request = controller.request_builder().build(
            list(range(3, 3 + 160)), SamplingParams(max_tokens=2, ignore_eos=True)
        )
        rid = controller.add_request(request)
        while controller.has_unfinished():
            controller.step()
        assert len(controller.release(rid).token_ids) == 2
    finally:
        controller.shutdown()
    steps = sorted(controller.step_timings)
    chunks = steps[:10]  # 160 prompt tokens in chunks of 16
    assert len(chunks) == 10
    overlaps = 0
    for (_, this), (_, nxt) in zip(chunks, chunks[1:], strict=False):
        this_last_end = max(end for stage, _, end in this if stage == 2)
        next_first_start = min(start for stage, start, _ in nxt if stage == 0)
        overlaps += next_first_start < this_last_end
    assert overlaps >= 5, f"only {overlaps} of 9 chunk pairs overlapped: {chunks}"


def test_worker_killed_mid_generation_recovers(cluster, reference):
    """The controller rebuilds its workers and recomputes: same tokens, nothing lost."""
    controller = ReplicaController.build(tiny_model_dir("dense"), tp=2, spp=1, **OPTIONS)
    killed = []

    def kill_once(c, ids):
        produced = sum(len(c.output(rid).token_ids) for rid in ids)
        if not killed and produced >= 4:
            killed.append(c.executor.actors[1])
            ray.kill(c.executor.actors[1])

    try:
        tokens = generate(controller, kill_once)
    finally:
        controller.shutdown()
    assert killed and controller.num_recoveries == 1
    assert tokens == reference
    assert controller.kv.check_blocks() == [0] * controller.kv.kvp


def test_an_idle_replica_restarts_a_worker_group_that_lost_a_worker(cluster, reference):
    """A worker of an idle replica (a warm standby) dies: ``check_workers`` finds it and
    brings the group up again before any request, which then gets the same tokens."""
    controller = ReplicaController.build(tiny_model_dir("dense"), tp=2, spp=1, **OPTIONS)
    try:
        assert generate(controller) == reference
        controller.on_idle()  # the compiled graph torn down, as an idle engine loop does
        assert controller.check_workers() is False  # all alive: nothing to do
        dead = controller.executor.actors[1]
        ray.kill(dead)
        wait_until_dead(dead)
        assert controller.check_workers() is True
        assert controller.num_recoveries == 1 and dead not in controller.executor.actors
        assert controller.check_workers() is False
        assert generate(controller) == reference
        assert controller.num_recoveries == 1
    finally:
        controller.shutdown()


def wait_until_dead(actor, timeout: float = 60) -> None:
    """Until a call to ``actor`` fails as a dead actor's: a kill goes through Ray's control
    store, so a call made right after it may still reach the living actor and succeed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.05)


def test_kv_parallel_prefix_hit_past_the_first_rank_in_float32(cluster):
    """fp32 (the CPU fast path) on kvp=2: a prompt whose cached prefix fills the first
    rank's 48 tokens computes only on the second rank, so the first runs a step with no
    token of its own; the tokens equal the single-process engine's, hit or not."""
    options = dict(OPTIONS, dtype=torch.float32)
    prompt = list(range(3, 3 + 70))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(controller):
        builder = controller.request_builder()
        outs = []
        for _ in range(2):  # the second run hits the first's cached prefix
            rid = controller.add_request(builder.build(prompt, params))
            while controller.has_unfinished():
                controller.step()
            outs.append(controller.release(rid))
        return outs

    single = ReplicaController.build(tiny_model_dir("dense"), **options)
    split = ReplicaController.build(tiny_model_dir("dense"), kvp=2, **options)
    try:
        reference, outs = run(single), run(split)
    finally:
        single.shutdown()
        split.shutdown()
    assert outs[1].num_cached_tokens >= 48  # the whole first rank: it computes nothing
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert split.kv.check_blocks() == [0, 0]
