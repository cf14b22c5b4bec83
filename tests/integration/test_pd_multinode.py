"""A disaggregated deployment over two Ray nodes (two raylets on this machine, each with its
own node id): the prefill replica runs on one node and the decode replica on the other, so
every layer's KV streams between nodes (over NIXL where a NIXL package is installed, else
over the TCP backend), while each node's KV store shard serves its
own prefill replica through shared memory. Output equals a colocated replica's; no block
leaks."""

from __future__ import annotations

import pytest
import ray
from pd_common import PARAMS, colocated, pd_config, tokens, two_node_cluster

from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from store.transfer.nixl_backend import nixl_api


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    yield from two_node_cluster()


def test_prefill_and_decode_on_two_nodes_stream_kv_between_nodes():
    shared = tokens(1, 16)
    prompts = [shared + tokens(2, 5), tokens(3, 22), shared + tokens(4, 9)]
    pd = PDCluster(pd_config(store=StoreConfig(dram_bytes=1 << 20)))
    assert len(pd.placement_plan.nodes) == 2
    assert sorted(pd.shards) == ["s0", "s1"]  # a shard per node
    prefill_node = ray.get(pd.prefills["p0"].node.remote())
    decode_node = ray.get(pd.decodes["d0"].node.remote())
    assert prefill_node != decode_node  # disaggregated across nodes
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    stats = pd.prefill_stats()["p0"]
    across = "nixl" if nixl_api() is not None else "tcp"
    assert list(stats.backends.values()) == [across]  # the decode cache, across nodes
    assert stats.layers_streamed > 0
    # new blocks went to the prefill replica's own node, and the shared prefix came back
    home = pd.home_shard("p0")
    assert home is not None and pd.store_client is not None
    assert pd.store_client.endpoints[home].node_id == prefill_node
    assert stats.stored_blocks > 0 and outs[2].num_cached_tokens == len(shared)
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
