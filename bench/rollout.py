"""Offline rollouts against vLLM's offline ``LLM.generate``: the whole job with model load,
and the generation alone, on the same Hugging Face folder and the same token ids.

Workload: ShareGPT first turns (vLLM's filter), each a one-message chat in SmolLM2's
template, greedy (or sampled at ``--temperature``, as RL rollouts draw; without per-line
seeds, which vLLM 0.32's CPU build fails on here: "CPU Generator does not use offset"), each
output's length fixed at its reply's length capped at ``--max-output`` (``min_tokens =
max_tokens``). The same JSONL goes to every side:

- ``job``: ``python -m actors.rollout --input F --output O --model DIR`` at its defaults
  (a fresh local Ray cluster, replica actors); generation alone is the job's own
  ``generated N tokens in S s`` line (first request submitted to last finished);
- ``inproc``: ``LLM(DIR).generate(...)`` in a fresh process (this file, ``--side inproc``);
- ``vllm``: ``bench/rollout_vllm.py`` in vLLM's venv (``--vllm-python``), vLLM 0.32's
  ``LLM(model=DIR, dtype="float32").generate``.

The whole job is each side's process from start to exit. Sides run interleaved (job, inproc,
vllm, job, ...) ``--repeats`` times; medians. Cases: each ``--models`` x ``--prompts``.
The last line is the worst case's ``generate tok/s`` ratio, Meridian's worse side over vLLM:
``rollout generate tok/s meridian/vllm: <ratio>``.

    python bench/rollout.py --vllm-python VENV/bin/python \\
        [--models smollm2 qwen2-0.5b] [--prompts 128 1024] [--repeats 3] [--max-output 128]
        [--temperature 0]

Sampled outputs are not expected to equal vLLM's (another random stream): the agreement
column is for greedy runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.interleave import interleaved

ROOT = Path(__file__).resolve().parent.parent

GENERATED = re.compile(r"generated (\d+) tokens in ([0-9.]+) s")
SIDES = ("job", "inproc", "vllm")


def write_prompts(
    path: Path, count: int, max_output: int, temperature: float, seed: int = 0
) -> int:
    """ShareGPT first turns as token ids with fixed output lengths; returns how many."""
    from bench.real_prompts import chat_ids, tokenizer
    from sim.datasets import sample_sharegpt

    tok = tokenizer("SmolLM2-135M-Instruct")
    reqs = sample_sharegpt(count, tok.encode, seed=seed, max_output=max_output)
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(reqs):
            ids = chat_ids(tok, r.prompt)
            line = {"id": str(i), "prompt_token_ids": ids, "max_tokens": r.output_len}
            line["min_tokens"] = r.output_len
            if temperature:
                line["temperature"] = temperature
            f.write(json.dumps(line) + "\n")
    return len(reqs)


def model_folder(name: str, work: Path) -> Path:
    if name == "qwen2-0.5b":
        from bench.bench_model import write_qwen2_05b

        return write_qwen2_05b(work / "qwen2-0.5b")
    from models.gguf_convert import convert_gguf
    from models.pretrained import pretrained_file

    return convert_gguf(pretrained_file("SmolLM2-135M-Instruct"), work / "smollm2")


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str, str]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return took, proc.stdout, proc.stderr


def run_side(side: str, folder: Path, prompts: Path, work: Path, vllm_python: str) -> dict:
    """{"whole_s", "generate_s", "tokens", "outputs": id -> token ids} of one run."""
    if side == "job":
        out = work / "job_out.jsonl"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "actors.rollout", "--input", str(prompts)]
        whole, _, err = timed([*cmd, "--output", str(out), "--model", str(folder)])
        match = GENERATED.findall(err)
        if not match:
            raise SystemExit(f"the rollout job printed no 'generated' line:\n{err[-2000:]}")
        tokens, seconds = match[-1]
        with open(out, encoding="utf-8") as f:
            outputs = {(r := json.loads(line))["id"]: r["token_ids"] for line in f}
        return dict(whole_s=whole, generate_s=float(seconds), tokens=int(tokens), outputs=outputs)
    if side == "inproc":
        cmd = [sys.executable, __file__, "--side-inproc", str(folder), str(prompts)]
    else:
        script = str(ROOT / "bench" / "rollout_vllm.py")
        cmd = [vllm_python, script, "--model", str(folder), "--input", str(prompts)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    whole, out_text, _ = timed(cmd, env)
    lines = [line for line in out_text.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{side} printed no result line:\n{out_text[-2000:]}")
    result = json.loads(lines[-1])
    return dict(result, whole_s=whole)


def side_inproc(folder: str, prompts: str) -> None:
    """``--side inproc``: LLM in this process, as a user would call it."""
    t0 = time.monotonic()
    from actors import LLM, SamplingParams

    with open(prompts, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    llm = LLM(folder)
    load_s = time.monotonic() - t0
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"],
            min_tokens=r["min_tokens"],
            temperature=r.get("temperature", 0.0),
        )
        for r in lines
    ]
    t0 = time.monotonic()
    ids = [r["prompt_token_ids"] for r in lines]
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    generate_s = time.monotonic() - t0
    outputs = {r["id"]: o.token_ids for r, o in zip(lines, outs, strict=True)}
    tokens = sum(len(t) for t in outputs.values())
    print(json.dumps(dict(load_s=load_s, generate_s=generate_s, tokens=tokens, outputs=outputs)))


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """The share of outputs whose token ids are equal on both sides."""
    return sum(a[k] == b.get(k) for k in a) / max(1, len(a))


def run_case(model: str, count: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    folder = model_folder(model, work)
    prompts = work / f"prompts_{count}.jsonl"
    n = write_prompts(prompts, count, args.max_output, args.temperature)

    def one(side: str, r: int) -> dict:
        res = run_side(side, folder, prompts, work, args.vllm_python)
        load = os.getloadavg()[0]
        print(
            f"  {model} {n} prompts, repeat {r + 1}, {side}: whole {res['whole_s']:.1f} s, "
            f"generate {res['generate_s']:.1f} s = {res['tokens'] / res['generate_s']:.1f} "
            f"tok/s ({res['tokens']} tokens), load {load:.1f}",
            flush=True,
        )
        return res

    runs = interleaved(args.sides, args.repeats, one, rotate=False)
    med = {
        s: dict(
            whole_s=statistics.median(x["whole_s"] for x in rs),
            tok_s=statistics.median(x["tokens"] / x["generate_s"] for x in rs),
        )
        for s, rs in runs.items()
    }
    agree = {
        s: agreement(runs[s][-1]["outputs"], runs["vllm"][-1]["outputs"])
        for s in args.sides
        if s != "vllm" and "vllm" in runs
    }
    return dict(model=model, prompts=n, med=med, agree=agree)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--side-inproc":
        side_inproc(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu")
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2-0.5b"])
    ap.add_argument("--prompts", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = ap.parse_args()
    if "vllm" not in args.sides:
        ap.error("--sides must include vllm: every ratio is against it")
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for count in args.prompts:
                cases.append(run_case(model, count, args, Path(tmp)))
    print()
    print(
        "| model | prompts | side | whole job s | generate tok/s | tok/s over vLLM | "
        "vLLM whole / side whole | outputs equal to vLLM's |"
    )
    print("|---|---|---|---|---|---|---|---|")
    worst = float("inf")
    for c in cases:
        v = c["med"]["vllm"]
        for side, m in c["med"].items():
            ratio = m["tok_s"] / v["tok_s"]
            if side != "vllm":
                worst = min(worst, ratio)
            agree = c["agree"].get(side)
            print(
                f"| {c['model']} | {c['prompts']} | {side} | {m['whole_s']:.1f} | "
                f"{m['tok_s']:.1f} | {ratio:.2f} | {v['whole_s'] / m['whole_s']:.2f} | "
                f"{'-' if agree is None else f'{agree:.2f}'} |"
            )
    print(f"rollout generate tok/s meridian/vllm: {worst:.2f}")


if __name__ == "__main__":
    main()
