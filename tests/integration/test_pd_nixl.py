"""The disaggregated deployment over two Ray nodes (two raylets on this machine) with NIXL
installed: every layer's KV streams from the prefill node into the decode node's cache
through NIXL's UCX backend instead of TCP, and the output equals a colocated replica's.
Skipped where no NIXL package is installed (not a project dependency)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from pd_common import PARAMS, colocated, pd_config, tokens, two_node_cluster

from actors.disagg.cluster import PDCluster
from store.transfer.nixl_backend import nixl_api

api = nixl_api()
pytestmark = pytest.mark.skipif(api is None, reason="no NIXL package installed")


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    assert api is not None and api.__file__ is not None
    yield from two_node_cluster(Path(api.__file__).resolve().parents[1])  # NIXL's package


def test_kv_streams_across_nodes_over_nixl():
    prompts = [tokens(5, 21), tokens(6, 30)]
    pd = PDCluster(pd_config())
    prefill_node = ray.get(pd.prefills["p0"].node.remote())
    decode_node = ray.get(pd.decodes["d0"].node.remote())
    assert prefill_node != decode_node
    outs = pd.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == colocated(prompts)
    stats = pd.prefill_stats()["p0"]
    assert list(stats.backends.values()) == ["nixl"]  # not TCP
    assert stats.layers_streamed > 0 and stats.bytes_streamed > 0
    assert set(pd.check_blocks().values()) == {0}
    pd.shutdown()
