"""``LLM(num_replicas=2)``: replica actors on a private local Ray cluster, routed by the
cache-aware router, give exactly the in-process engine's greedy tokens."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)


PROMPTS = [
    "The quick brown fox",
    "Hello, Meridian!",
    "Once upon a time, in a land far away, there lived a model",
    "Once upon a time, in a land far away, there lived a router",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "Short",
]


def test_replicas_generate_equals_in_process(connected_ray_cluster):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = LLM().generate(PROMPTS, params)
    llm = LLM(num_replicas=2, kv_cache_memory=1 << 25)
    try:
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        assert [o.text for o in outs] == [r.text for r in reference]
        assert all(o.finish_reason == "length" and o.finished for o in outs)
        # Unordered results name each prompt exactly once and match too.
        pairs = list(llm.generate_unordered(PROMPTS, params))
        assert sorted(i for i, _ in pairs) == list(range(len(PROMPTS)))
        assert all(out.token_ids == reference[i].token_ids for i, out in pairs)
        # The second pass over the same prompts was routed to where they are cached.
        assert sum(out.num_cached_tokens for _, out in pairs) > 0
        # Bad input fails the whole call cleanly, before anything runs.
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate(["fine", "x" * 5000], params)
        assert llm.generate(PROMPTS[:1], params)[0].token_ids == reference[0].token_ids
    finally:
        llm.close()
