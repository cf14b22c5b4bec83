"""Offline rollouts as a Ray job: submit, stop it midway, resubmit; the output holds
exactly one line per input, and the lines written before the stop are kept as they were.

The job runs ``python -m actors.rollout`` from the uploaded working dir (``--working-dir``
equivalent) on a private local Ray cluster with its dashboard (the job server)."""

from __future__ import annotations

import json
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(900)

N = 48
# line 0 asks for penalties, a bias and top logprobs of its own
LINE0 = {"presence_penalty": 1.0, "logit_bias": {"7": 3.0}, "logprobs": 2}


@pytest.fixture(scope="module")
def cluster(local_ray_cluster):
    c = local_ray_cluster(dashboard=True)
    try:
        yield c
    finally:
        c.stop()


def submit(client, cluster, inp, out) -> str:
    entry = (
        f"{sys.executable} -m actors.rollout --input {inp} --output {out} "
        "--num-replicas 2 --max-in-flight 4 --max-tokens 24 --temperature 0"
    )
    return client.submit_job(
        entrypoint=entry,
        runtime_env={
            "working_dir": str(cluster.REPO),
            "excludes": [".git", ".venv", "*.jsonl"],
        },
    )


def wait_status(client, job, want, timeout=600):
    deadline = time.monotonic() + timeout
    while (status := client.get_job_status(job)) not in want:
        assert status.is_terminal() is False, client.get_job_logs(job)[-4000:]
        assert time.monotonic() < deadline, f"job {job} still {status}"
        time.sleep(0.5)
    return status


def lines_of(path):
    return path.read_text().splitlines() if path.exists() else []


def test_rollout_job_killed_and_resumed(cluster, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard_url)
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    with open(inp, "w") as f:
        for i in range(N):
            rec = {"id": f"p{i}", "prompt": f"Prompt number {i}: tell me about {i * 7}"}
            rec.update(LINE0 if i == 0 else {})
            f.write(json.dumps(rec) + "\n")

    job = submit(client, cluster, inp, out)
    wait_status(client, job, {JobStatus.RUNNING})
    deadline = time.monotonic() + 600
    while len(lines_of(out)) < 3:  # midway: some results are written, most are not
        assert client.get_job_status(job) == JobStatus.RUNNING, client.get_job_logs(job)[-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    client.stop_job(job)
    wait_status(client, job, {JobStatus.STOPPED, JobStatus.FAILED, JobStatus.SUCCEEDED})
    first = lines_of(out)
    assert 3 <= len(first) < N, "the job was not stopped midway"
    # A kill in the middle of a write leaves a torn line; the rerun must cut it off.
    with open(out, "a") as f:
        f.write('{"id": "p999", "text": "tor')

    job2 = submit(client, cluster, inp, out)
    status = wait_status(client, job2, {JobStatus.SUCCEEDED, JobStatus.FAILED})
    logs = client.get_job_logs(job2)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert f"{len(first)} already done" in logs

    final = lines_of(out)
    records = [json.loads(line) for line in final]  # every line is whole JSON
    ids = [r["id"] for r in records]
    assert len(ids) == N and sorted(ids) == sorted(f"p{i}" for i in range(N))
    assert final[: len(first)] == first  # the first run's lines are kept as written
    assert all(r["finish_reason"] in {"stop", "length"} for r in records)
    assert all(r["index"] == int(r["id"][1:]) for r in records)
    # every line carries each sampled token's logprob, as the in-process engine computes it
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in records)
    from actors import LLM, SamplingParams

    llm = LLM()
    by_id = {r["id"]: r for r in records}
    for i, extra in ((0, LINE0), (5, {"logprobs": 0})):
        p = SamplingParams(max_tokens=24, temperature=0.0, **extra)
        (ref,) = llm.generate(f"Prompt number {i}: tell me about {i * 7}", p)
        got = by_id[f"p{i}"]
        assert got["token_ids"] == ref.token_ids
        assert got["logprobs"] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
        tops = [[t for t, _ in lp.top] for lp in ref.logprobs]
        assert [[t for t, _ in top] for top in got.get("top_logprobs", [])] == (
            tops if i == 0 else []
        )
