"""A P/D cluster whose sides have their own KV sizes: the decode pool is sized by its
side, the output equals a colocated replica's, and a request larger than the (smaller)
prefill pool is refused up front instead of waiting for prefill room that never comes."""

from __future__ import annotations

import pytest
from pd_common import OPTS, PARAMS, cluster, colocated, tokens  # noqa: F401

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.engine.config import EngineConfig
from errors import ContextLengthError

KIB = 1 << 10


def test_sides_with_their_own_kv_sizes():
    engine = EngineConfig(**{k: v for k, v in OPTS.items() if k != "num_blocks"})
    config = PDClusterConfig(
        engine=engine,
        prefill=PDSideConfig(kv_cache_memory=512 * KIB),
        decode=PDSideConfig(kv_cache_memory=1536 * KIB),
        fit_costs=False,
    )
    pd = PDCluster(config)
    decode_blocks = [v.total_blocks for v in pd.decode_views.values()]
    prefill_tokens = pd.limits.kv_capacity_tokens  # the prefill pool is the smaller
    assert decode_blocks[0] * OPTS["block_size"] == 3 * prefill_tokens
    prompts = [tokens(2, 5), tokens(5, 30)]
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    with pytest.raises(ContextLengthError):
        pd.generate(prompt_token_ids=[tokens(7, prefill_tokens)], sampling_params=PARAMS)
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
