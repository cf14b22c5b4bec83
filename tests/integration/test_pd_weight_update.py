"""Weights updated in place on a disaggregated deployment (``PDCluster.update_weights``,
which ``LLM(num_prefill=..., num_decode=...).update_weights`` calls): the tokens equal
transformers' on the new weights, a prefix the store holds from before the update is never
loaded after it (the block hashes carry the weight version), and a replica started after
the update loads it too."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from pd_common import OPTS, PARAMS, cluster, pd_config, tokens  # noqa: F401

from actors import LLM
from actors.disagg.cluster import PDCluster
from actors.disagg.store_view import StoreConfig
from errors import InvalidRequestError
from models import write_tiny_model
from models.hf_reference import hf_greedy
from models.tiny import write_perturbed_copy
from store.shared_segment import DEFAULT_SHM_DIR, PREFIX

pytestmark = pytest.mark.timeout(600)
NEW = PARAMS.max_tokens


def loaded_blocks(pd: PDCluster) -> int:
    return sum(s.loaded_blocks for s in pd.prefill_stats().values())


def drop_local_caches(pd: PDCluster) -> None:
    ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])


def test_pd_update_keys_the_store_by_weight_version(tmp_path):
    base = write_tiny_model(tmp_path / "base")
    tensors, noisy = write_perturbed_copy(base, tmp_path / "noisy", seed=5)
    prompt = tokens(41, 26)  # 6 full blocks of 4
    old, new = hf_greedy(base, [prompt], NEW)[0], hf_greedy(noisy, [prompt], NEW)[0]
    assert old != new
    block_bytes = pd_config(model_dir=str(base)).kv_block_bytes(on_gpu=False)
    pd = PDCluster(pd_config(model_dir=str(base), store=StoreConfig(64 * block_bytes)))
    try:
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == old  # computed, and its full blocks written to the store
        drop_local_caches(pd)
        before = loaded_blocks(pd)
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == old and loaded_blocks(pd) - before == 6  # from the store

        with pytest.raises(InvalidRequestError, match="not a tensor of this model"):
            pd.update_weights({"model.layers.0.mlp.up_proj.weigth": tensors["model.norm.weight"]})
        assert pd.weight_version == 0

        pd.update_weights(tensors)
        drop_local_caches(pd)
        before = loaded_blocks(pd)
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == new
        assert loaded_blocks(pd) == before  # the old weights' blocks are not found
        drop_local_caches(pd)
        (out,) = pd.generate(prompt_token_ids=[prompt], sampling_params=PARAMS)
        assert out.token_ids == new and loaded_blocks(pd) - before == 6  # the new ones are

        # the prefill replica dies; its replacement loads the update when it starts
        ray.kill(pd.prefills["p0"], no_restart=True)
        (out,) = pd.generate(prompt_token_ids=[tokens(42, 9)], sampling_params=PARAMS)
        assert pd.num_prefill_restarts == 1
        assert out.token_ids == hf_greedy(noisy, [tokens(42, 9)], NEW)[0]
        assert set(pd.check_blocks().values()) == {0}
    finally:
        pd.shutdown()


def shm_blocks() -> dict[str, int]:
    """Each Meridian shared-memory segment's allocated 512-byte blocks."""
    return {p.name: p.stat().st_blocks for p in Path(DEFAULT_SHM_DIR).glob(PREFIX + "*")}


def test_llm_pd_update_weights_gives_the_new_weights_tokens(tmp_path):
    base = write_tiny_model(tmp_path / "base")
    tensors, noisy = write_perturbed_copy(base, tmp_path / "noisy", seed=6)
    prompts = [tokens(43, 13), tokens(44, 22)]
    llm = LLM(base, num_prefill=1, num_decode=1, **OPTS)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == hf_greedy(base, prompts, NEW)
        llm.update_weights(tensors)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        want = hf_greedy(noisy, prompts, NEW)
        assert [o.token_ids for o in outs] == want

        # sleep(1) frees every replica's KV cache: the decode worker's shared-memory
        # segment gives its pages back (its name stays, for the prefill workers) and gets
        # them again on the wake; the tokens after it are exact
        before = shm_blocks()
        freed = llm.sleep(1)
        asleep = shm_blocks()
        released = [n for n, b in before.items() if b > 0 and asleep.get(n) == 0]
        assert released and freed >= 512 * sum(before[n] for n in released)
        with pytest.raises(InvalidRequestError, match="asleep"):
            llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        llm.wake_up()
        assert all(shm_blocks().get(n, 0) > 0 for n in released)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == want

        # sleep(2) frees the weights too; generate is refused until wake_up, which brings
        # back the updated weights
        assert llm.sleep(2) > freed
        with pytest.raises(InvalidRequestError, match="asleep"):
            llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        llm.wake_up()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        assert [o.token_ids for o in outs] == want
    finally:
        llm.close()
