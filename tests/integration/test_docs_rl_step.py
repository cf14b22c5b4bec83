"""docs/serving.md's RL loop (rollout, score, policy-gradient step, ``update_weights``) runs
as written, and the engine it leaves behind runs the trained weights, not the stored ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from readme_common import readme_block

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"

# Appended to the block: the updated engine's logprobs of one sample differ from an engine
# on the stored weights (the loop's own asserts show they match the trainer's).
CHECK = """
stale = LLM(model_dir)
p = [SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=0)]
new, old = (e.generate(prompt_token_ids=group[:1], sampling_params=p)[0] for e in (llm, stale))
shift = max(abs(a.logprob - b.logprob) for a, b in zip(new.logprobs, old.logprobs))
assert new.token_ids != old.token_ids or shift > 1e-3, shift
print("trained", shift)
"""


def test_the_rl_step_example_runs_and_trains_the_engine():
    code = readme_block("python", "llm.update_weights(policy.state_dict())", doc=DOC)
    result = subprocess.run(
        [sys.executable, "-c", code + CHECK],
        cwd=DOC.parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert "trained" in result.stdout
