"""Offline rollouts as a Ray job: generate for every line of a JSONL file, resumably.

    ray job submit --working-dir . -- python -m actors.rollout \\
        --input /data/prompts.jsonl --output /data/results.jsonl --num-replicas 2

Input lines are JSON objects with ``prompt`` (text), ``messages`` (chat) or
``prompt_token_ids``, an optional ``id`` (default: the line's 0-based index) and optional
per-line sampling fields (``LINE_PARAMS``: ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, the penalties, ``logit_bias``, ``min_tokens``,
``response_format``, ``logprobs``). Each output line is ``{"id", "index", "text",
"token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens"}``, in
completion order; ``logprobs`` holds each sampled token's logprob (``--logprobs-mode``:
"raw", the model's log-softmax, the default, or "processed", the distribution it was
drawn from), and with ``--top-logprobs k`` (or a line's ``logprobs: k``) a
``top_logprobs`` list of ``[[token id, logprob], ...]`` per token too.

Resumable, exactly once: each result is appended as one whole line with one ``write`` as
it finishes. On start, a torn last line (a kill mid-write) is cut off, and every id already
in the output is skipped. Invariant: after any number of kills and reruns, the output holds
each input id at most once, and after a run that exits 0, exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from actors.engine.defaults import BATCH_MAX_IN_FLIGHT
from actors.engine.sampling import SamplingParams
from actors.llm import LLM
from errors import InvalidRequestError

LINE_PARAMS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "response_format",
    "logprobs",
)


def read_inputs(path: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """(id, line index, record) per non-blank line; ids must be unique."""
    items, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{index + 1}: not valid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise SystemExit(f"{path}:{index + 1}: each line must be a JSON object")
            rid = str(rec.get("id", index))
            if rid in seen:
                raise SystemExit(f"{path}:{index + 1}: duplicate id {rid!r}")
            seen.add(rid)
            items.append((rid, index, rec))
    return items


def recover_output(path: Path) -> set[str]:
    """Ids already written. Cuts a torn last line (no newline, or not JSON) off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    good = data.rfind(b"\n") + 1  # everything after the last newline is torn
    lines = data[:good].splitlines()
    done: set[str] = set()
    keep = 0
    for line in lines:
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a torn line can only be the last one we wrote; drop it and what follows
        keep += len(line) + 1
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return done


def tokens_of(llm: LLM, rec: dict[str, Any]) -> list[int]:
    if "prompt_token_ids" in rec:
        return [int(t) for t in rec["prompt_token_ids"]]
    if "messages" in rec:
        text = llm.tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True)
        return llm.tokenizer.encode(text, add_special_tokens=False)
    if "prompt" in rec:
        return llm.tokenizer.encode(str(rec["prompt"]))
    raise SystemExit(f"line with id {rec.get('id')!r} has no prompt, messages or token ids")


class Progress:
    def __init__(self, total: int, initial: int) -> None:
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, initial=initial, unit="prompt", file=sys.stderr)
        except ImportError:
            self.bar = None
        self.total, self.n, self.last = total, initial, 0.0

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif time.monotonic() - self.last > 1 or self.n == self.total:
            self.last = time.monotonic()
            print(f"{self.n}/{self.total} prompts", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, type=Path, help="JSONL of prompts")
    ap.add_argument("--output", required=True, type=Path, help="JSONL of results (appended)")
    ap.add_argument("--model", default=None, help="Hugging Face model folder (default: tiny)")
    ap.add_argument("--num-replicas", type=int, default=2)
    ap.add_argument("--attach", default=None, help="a running Serve app (name or URL) instead")
    ap.add_argument("--api-key", default=None, help="with --attach: the tenant's key")
    ap.add_argument("--routing", default="prefix_aware")
    ap.add_argument("--num-cpus", type=float, default=0.0, help="Ray CPUs per replica")
    ap.add_argument("--max-in-flight", type=int, default=BATCH_MAX_IN_FLIGHT)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="line i samples with seed + i")
    ap.add_argument("--top-logprobs", type=int, default=0, help="top logprobs per token")
    ap.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw")
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each prompt's tokens and logprobs bitwise independent of the batch (slower)",
    )
    args = ap.parse_args(argv)

    items = read_inputs(args.input)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    done = recover_output(args.output)
    todo = [it for it in items if it[0] not in done]
    print(f"{len(items)} prompts, {len(items) - len(todo)} already done", file=sys.stderr)
    if not todo:
        return
    if args.attach:
        llm = LLM.attach(args.attach, api_key=args.api_key, model=args.model)
    else:
        llm = LLM(
            args.model,
            num_replicas=args.num_replicas,
            routing=args.routing,
            num_cpus=args.num_cpus,
            max_in_flight=args.max_in_flight,
            batch_invariant=args.batch_invariant,
        )
    token_lists = [tokens_of(llm, rec) for _, _, rec in todo]
    params = []
    for rid, index, rec in todo:
        kw: dict[str, Any] = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "logprobs": args.top_logprobs,
            "logprobs_mode": args.logprobs_mode,
        }
        if args.seed is not None:
            kw["seed"] = args.seed + index
        kw.update({k: rec[k] for k in LINE_PARAMS if k in rec})
        try:
            params.append(SamplingParams(**kw))
        except (InvalidRequestError, TypeError) as e:
            raise SystemExit(f"{args.input}: line with id {rid!r}: {e}") from None

    progress = Progress(len(items), len(items) - len(todo))
    fd = os.open(args.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    generated, started = 0, time.monotonic()
    try:
        for i, out in llm.generate_unordered(prompt_token_ids=token_lists, sampling_params=params):
            rid, index, _ = todo[i]
            line = {
                "id": rid,
                "index": index,
                "text": out.text,
                "token_ids": out.token_ids,
                "logprobs": [lp.logprob for lp in out.logprobs or []],
                "finish_reason": out.finish_reason,
                "num_prompt_tokens": len(token_lists[i]),
                "num_cached_tokens": out.num_cached_tokens,
            }
            if out.logprobs and any(lp.top for lp in out.logprobs):
                line["top_logprobs"] = [[list(t) for t in lp.top] for lp in out.logprobs]
            data = (json.dumps(line) + "\n").encode("utf-8")
            if os.write(fd, data) != len(data):  # one write per line: whole, or torn and cut
                raise OSError(f"short write to {args.output}")
            generated += len(out.token_ids)
            progress.update()
        took = time.monotonic() - started
        os.fsync(fd)
    finally:
        os.close(fd)
        progress.close()
        llm.close()
    print(f"wrote {len(todo)} results to {args.output}", file=sys.stderr)
    # from the first request submitted to the last finished (bench/rollout.py reads it)
    print(
        f"generated {generated} tokens in {took:.3f} s ({generated / took:.1f} tokens/s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
