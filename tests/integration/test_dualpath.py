"""DualPath on a local Ray cluster: decode replicas write every full block back to the KV
store as it fills, so a conversation's next turn hits its own previous answer, with output
equal to a colocated replica's."""

from __future__ import annotations

import ray
from pd_common import BS, OPTS, cluster, colocated, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from actors.engine.sampling import SamplingParams

ANSWER = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def second_turn_cached(write_back: bool) -> tuple[int, list[int], int]:
    """Turn 1, then turn 2 = turn 1's prompt + its answer + a new message, on a prefill
    replica that forgot its own cache (so the prefix comes from the store). Returns turn
    2's cached tokens, its tokens, and the blocks the decode side wrote back in turn 1."""
    first = tokens(101, 30)  # 7 full blocks and 2 tokens
    pd = PDCluster(None, store=StoreConfig(dram_bytes=64 << 20, write_back=write_back), **OPTS)
    try:
        (out1,) = pd.generate(prompt_token_ids=[first], sampling_params=ANSWER)
        assert out1.token_ids == colocated([first], ANSWER)[0]
        written = sum(
            ray.get(h.report.remote(0.0)).stats.stored_blocks for h in pd.decodes.values()
        )
        second = first + out1.token_ids + tokens(102, 7)
        ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
        (out2,) = pd.generate(prompt_token_ids=[second], sampling_params=ANSWER)
        assert out2.token_ids == colocated([second], ANSWER)[0]
        written2 = sum(
            ray.get(h.report.remote(0.0)).stats.stored_blocks for h in pd.decodes.values()
        )
        if write_back:  # turn 2's answer too: 49 + 11 computed tokens, 15 full blocks
            assert written2 - written == 15 - 12
        assert set(pd.check_blocks().values()) == {0}
        return out2.num_cached_tokens, out2.token_ids, written
    finally:
        pd.shutdown()


def test_write_back_makes_the_next_turn_hit_its_own_previous_answer():
    cached, got, written = second_turn_cached(write_back=True)
    # turn 1 held 30 + 12 tokens; the last one's KV is never computed: 41 tokens, 10 full
    # blocks, 3 of them (tokens 28..39) holding the answer, written back by decode
    assert written == 3
    assert cached == 10 * BS  # well past turn 1's prompt (30): its answer came back
    base_cached, base_got, base_written = second_turn_cached(write_back=False)
    assert base_written == 0
    assert base_cached == 7 * BS  # without write-back only turn 1's prompt blocks hit
    assert got == base_got
