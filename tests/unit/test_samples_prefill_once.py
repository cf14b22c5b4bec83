"""``n`` samples of one prompt (GRPO's groups) prefill it once: the first sample computes
the prompt's blocks while the others wait (``Scheduler._waits_for_a_sharer``), then attach
them from the prefix cache, as its counters show; the tokens are the ones each sample
gets alone."""

from __future__ import annotations

from actors.engine.config import EngineConfig
from actors.engine.replica_controller import ReplicaController
from policies.request import SamplingParams

N, PROMPT = 4, [3 + (7 * i) % 400 for i in range(100)]  # 6 usable blocks of 16 tokens


def run(engine: ReplicaController, seeds: list[int]) -> dict[int, list[int]]:
    builder = engine.request_builder()
    ids = {}
    for seed in seeds:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        ids[seed] = engine.add_request(builder.build(PROMPT, params, request_id=f"s{seed}"))
    while engine.has_unfinished():
        engine.step()
    return {seed: list(engine.release(rid).token_ids) for seed, rid in ids.items()}


def test_n_samples_compute_the_prompt_once_and_sample_as_alone():
    engine = ReplicaController.build(None, EngineConfig(kv_cache_memory=1 << 24))
    together = run(engine, list(range(N)))
    kv = engine.one_rank_kv
    assert kv.hit_tokens == (N - 1) * 96  # every other sample reused the first's 6 blocks
    for seed in range(N):
        engine.kv.evict_all_cached()
        assert run(engine, [seed]) == {seed: together[seed]}
    engine.shutdown()
