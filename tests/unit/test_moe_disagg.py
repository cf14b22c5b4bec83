"""Attention/expert disaggregation in process (actors/moe): the same greedy tokens as the
single-process model for every micro-batch count, with hot experts replicated, uneven
routing, experts and expert workers that receive nothing in a round, and both attention
workers holding requests."""

from __future__ import annotations

import random
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors import LLM, SamplingParams
from actors.engine.step_plan import PlanEntry
from actors.moe.executor import LocalMoEExecutor
from actors.moe.messages import attention_worker_of, micro_batches_of
from actors.moe.workers import AttentionWorker, ExpertWorker, sent_bytes
from models import write_tiny_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """8 experts, top 2 (a decode micro-batch of a few tokens leaves most experts idle),
    with uneven routing: the router rows of experts 6 and 1 are scaled up, so their logits
    are often the largest, and expert 3's down, so it is rarely chosen. In layer 0 the
    post-attention norm keeps only hidden dimension 0, and the router's logits are
    ``(5, 4, 0, 0, 0, 0, -4, -5) * h_0``: every token goes to experts {0, 1} or {6, 7}, so
    experts 2-5 of layer 0 never receive a token."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("moe8"), kind="moe", seed=7, num_local_experts=8
    )
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            tensor[6] *= 4.0
            tensor[1] *= 3.0
            tensor[3] *= 0.2
    norm = weights["model.layers.0.post_attention_layernorm.weight"]
    norm.zero_()
    norm[0] = 1.0
    gate = weights["model.layers.0.block_sparse_moe.gate.weight"]
    gate[:, 0] = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0, 0.0, -4.0, -5.0])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 17, 6, 12)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    llm = LLM(model_dir, dtype=torch.float64, block_size=4, chunk_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _disagg(model_dir, m, **extra):
    return LLM(
        model_dir,
        dtype=torch.float64,
        block_size=4,
        chunk_size=8,
        attention_workers=2,
        expert_workers=3,
        micro_batches=m,
        moe_in_process=True,
        **extra,
    )


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_disaggregated_tokens_equal_the_single_process_model(
    model_dir, prompts, reference, m, monkeypatch
):
    # Request ids are random and pick the attention worker; these fixed ones use both.
    ids = iter(range(1, 1 << 16))
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(ids) << 64))
    llm = _disagg(model_dir, m)
    executor = llm.engine.executor
    assert isinstance(executor, LocalMoEExecutor)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.kv.num_used_blocks == 0
    # Both attention workers held requests.
    owners = {attention_worker_of(o.request_id, 2) for o in outs}
    assert owners == {0, 1}
    # Every expert worker answered every round: (layers + 0) x m per step, same count.
    rounds = {w.rounds for w in executor.experts}
    assert len(rounds) == 1 and rounds.pop() % (4 * m) == 0
    # Routing is uneven: the hot experts served far more rows than the cold one.
    counts = executor.token_counts()
    assert min(counts[6], counts[1]) > 2 * counts[3]
    # Experts 2-5 of layer 0 received no token in any round, yet their workers got a
    # message every round.
    for worker in executor.experts:
        layer0 = [served for layer, _, served in worker.recent if layer == 0]
        assert len(layer0) == worker.rounds // 4
        for served in layer0:
            assert all(served[e] == 0 for e in served if 2 <= e <= 5)


def test_hot_expert_copies_and_idle_experts(model_dir, prompts, reference):
    # 8 experts on 3 workers x 4 slots: 4 spare slots hold copies of experts 0-3.
    llm = _disagg(model_dir, 3, expert_slots=4)
    executor = llm.engine.executor
    placement = executor.spec.placement
    assert [len(placement.replicas(e)) for e in range(8)] == [2, 2, 2, 2, 1, 1, 1, 1]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # One short request alone: each decode round routes one token to 2 of the 8 experts,
    # so most experts (and some expert workers) get nothing in a round.
    one = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    assert one[0].token_ids == reference[0]
    last = [list(w.recent)[-4 * 3 :] for w in executor.experts]  # the last step's rounds
    for rounds in zip(*last, strict=True):
        # one token, top 2: 2 rows in all, so 6 of the 8 experts got none this round
        served = [sum(r[2].values()) for r in rounds]
        assert sum(served) in (0, 2)
        held = [c for r in rounds for c in r[2].values()]
        assert held.count(0) >= len(held) - 2
    # an expert worker that received an empty message in some round
    assert any(sum(r[2].values()) == 0 for rounds in last for r in rounds)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == reference


def test_expert_placement_is_replanned_from_observed_rows(model_dir, prompts, reference):
    llm = _disagg(model_dir, 2, expert_slots=4, rebalance_experts_s=0.0)
    executor = llm.engine.executor
    first = executor.spec.placement
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == reference
    assert executor.num_replans >= 1
    now = executor.spec.placement
    assert now != first and now == executor.balancer.placement
    # The placement in use is within the balancer's threshold on the rows it observed
    # (policies/expert_balance.py's tests check when it re-plans).
    assert executor.balancer.imbalance() <= 1.2
    # The expert workers hold what the new placement says.
    assert [w.experts for w in executor.experts] == list(now.workers)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in again] == reference


def test_micro_batches_split_by_tokens():
    def entry(i, n):
        return PlanEntry(f"r{i}", 0, [1] * n, [(0, 0, [0])], None)

    groups = micro_batches_of([entry(i, 1) for i in range(7)], 3)
    assert [len(g) for g in groups] == [2, 3, 2]
    assert [e.request_id for g in groups for e in g] == [f"r{i}" for i in range(7)]
    # A long chunk and a few decodes: the chunk takes a group of its own.
    groups = micro_batches_of([entry(0, 1), entry(1, 12), entry(2, 1), entry(3, 1)], 3)
    assert [[e.request_id for e in g] for g in groups] == [["r0"], ["r1"], ["r2", "r3"]]
    # Fewer entries than micro-batches: the rest are empty.
    assert sum(len(g) for g in micro_batches_of([entry(0, 5)], 4)) == 1
    assert micro_batches_of([], 2) == [[], []]


def test_bad_layouts_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="together"):
        LLM(model_dir, attention_workers=2, moe_in_process=True)
    with pytest.raises(ValueError, match="tp = spp = kvp = 1"):
        LLM(model_dir, attention_workers=1, expert_workers=1, tp=2, moe_in_process=True)
    dense = write_tiny_model(tmp_path / "dense", kind="dense")
    with pytest.raises(ValueError, match="dense"):
        LLM(dense, attention_workers=1, expert_workers=1, moe_in_process=True)


def test_serve_replica_group_takes_the_same_keys():
    from actors.serving.config import ReplicaGroupConfig

    moe = {"attention_workers": 2, "expert_workers": 3, "micro_batches": 3}
    config = ReplicaGroupConfig(name="moe", num_replicas=1, engine=moe).engine
    assert (config.attention_workers, config.expert_workers, config.micro_batches) == (2, 3, 3)
    assert ReplicaGroupConfig(name="plain").engine.attention_workers == 0
    with pytest.raises(ValueError, match="together"):
        ReplicaGroupConfig(name="bad", engine={"attention_workers": 2})
    with pytest.raises(ValueError, match="colocated replicas"):
        ReplicaGroupConfig(
            name="pd",
            num_prefill=1,
            num_decode=1,
            engine={"attention_workers": 1, "expert_workers": 1},
        )


def test_default_micro_batches_follow_the_rule(model_dir):
    from actors.moe.executor import default_micro_batches
    from models.config import read_model_config

    cfg = read_model_config(model_dir)
    m = default_micro_batches(cfg, attention_workers=2, tokens_per_step=256, device="cpu")
    assert m in (3, 4)  # 2 (1 + Tc / Tf) with 0 < Tc < Tf
    llm = _disagg(model_dir, None)
    assert llm.engine.executor.spec.micro_batches == default_micro_batches(
        cfg, 2, llm.engine.engine_config.max_num_seqs, "cpu"
    )


def test_attention_expert_traffic_pays_the_compute_links(model_dir, prompts, reference):
    """``moe_link_bytes_per_s``: every activation message pays its sender's emulated link
    (EXEC class) before it leaves; tokens are unchanged, and the links carried exactly the
    bytes the messages hold."""
    llm = _disagg(model_dir, 2, moe_link_bytes_per_s=2e6)
    executor = llm.engine.executor
    sent = {"attention": 0, "expert": 0}
    attend, answer = AttentionWorker._attend, ExpertWorker.expert_round

    def counted_attend(self, *args):
        batches = attend(self, *args)
        sent["attention"] += sum(b.hidden.nbytes + b.experts.nbytes for b in batches)
        return batches

    def counted_answer(self, *args):
        replies = answer(self, *args)
        sent["expert"] += sum(r.out.nbytes for r in replies)
        return replies

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AttentionWorker, "_attend", counted_attend)
        mp.setattr(ExpertWorker, "expert_round", counted_answer)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == reference
    carried = {
        "attention": sum(sent_bytes(w.link) for w in executor.attention),
        "expert": sum(sent_bytes(w.link) for w in executor.experts),
    }
    assert carried == sent and min(sent.values()) > 0


def test_moe_link_needs_moe_workers():
    with pytest.raises(ValueError, match="moe_link_bytes_per_s"):
        LLM(moe_link_bytes_per_s=1e6)
