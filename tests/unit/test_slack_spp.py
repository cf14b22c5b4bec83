"""Medha's slack under sequence pipeline parallelism: a prompt's chunks pipeline through
the ``spp`` stages, so its remaining prefill time (and the deadline derived from its time
alone) is the pipeline's, not the chunks' whole-model times one after another."""

from __future__ import annotations

import pytest

from placement.runtime_predictor import RuntimePredictor
from policies.pd_costs import LinearPrefillTime
from policies.sequence import Sequence
from policies.slack import ILRS, Deadlines

CHUNK = 32


def predictor() -> RuntimePredictor:
    p = RuntimePredictor(chunk_size=CHUNK)
    p.prefill_time = LinearPrefillTime(
        base=1e-3, per_new_token=1e-4, per_cached_token=1e-6, per_attention_pair=1e-8
    )
    return p


def pipelined(pred: RuntimePredictor, new: int, context: int, stages: int) -> float:
    """When the last of ``new`` tokens' chunks leaves the last of ``stages`` equal stages,
    each chunk entering a stage once it left the previous stage and the previous chunk
    left this one (what the replica's pipeline does with a lone prompt)."""
    done = [0.0] * stages  # when the previous chunk left each stage
    for start in range(0, new, CHUNK):
        n = min(CHUNK, new - start)
        stage = pred.batch_time([(n, context + start)]) / stages
        left = 0.0
        for j in range(stages):
            left = max(left, done[j]) + stage
            done[j] = left
    return done[-1]


def seq(prompt: int, computed: int = 0) -> Sequence:
    s = Sequence("r", list(range(prompt)), max_tokens=4, arrival_time=0.0)
    s.num_computed_tokens = computed
    return s


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("new, context", [(320, 0), (1000, 0), (200, 512), (CHUNK, 0), (7, 64)])
def test_remaining_prefill_time_is_the_pipelines(stages, new, context):
    pred = predictor()
    want = pipelined(pred, new, context, stages)
    got = Deadlines(pred, stages=stages).prefill_time(new, context)
    # exact for one chunk; the last chunk priced full at the prompt's end: an upper bound
    # within 2% for longer prompts
    assert want <= got + 1e-12
    assert got == pytest.approx(want, rel=0.02)
    # chunk after chunk through the whole model is what one stage (no SPP) takes
    whole = pred.remaining_prefill_time(new, context)
    assert Deadlines(pred).prefill_time(new, context) == whole
    if new > CHUNK:
        assert got < whole * (1 + stages) / (2 * stages)  # most of it divided by the stages


def test_slack_and_derived_deadlines_follow_the_stages():
    pred = predictor()
    one, two = Deadlines(pred, slo_factor=3.0), Deadlines(pred, slo_factor=3.0, stages=2)
    long = 2048
    assert two.slo(seq(long)) == pytest.approx(3 * pipelined(pred, long, 0, 2), rel=0.02)
    assert two.slo(seq(long)) < 0.6 * one.slo(seq(long))
    # half computed: the rest pipelines after the computed context
    half = seq(long, computed=1024)
    assert two.remaining(half) == pytest.approx(pipelined(pred, 1024, 1024, 2), rel=0.02)
    assert two.remaining(half) < 0.6 * one.remaining(half)
    # an explicit SLO is kept; slack is that deadline less the pipelined remainder
    own = seq(long, computed=1024)
    own.ttft_slo = 5.0
    assert two.slack(own, 1.0) == pytest.approx(5.0 - 1.0 - two.remaining(own))
    with pytest.raises(ValueError, match="stages"):
        Deadlines(pred, stages=0)


def test_a_pipelined_replicas_orderings_price_its_stages():
    """The engine builds its deadline orderings with its own ``spp``."""
    from actors.engine.config import EngineConfig
    from actors.engine.controller_builder import _scheduler
    from store.block_pool import BlockPool
    from store.kv_manager import KVCacheManager

    for spp in (1, 2):
        kv = KVCacheManager(BlockPool(64, 16), enable_prefix_caching=False)
        _, sched = _scheduler(EngineConfig(spp=spp, scheduling="ilrs"), kv)
        assert isinstance(sched.ordering, ILRS) and sched.ordering.deadlines.stages == spp
