"""Real prompts for the seed benches (``--model M --dataset sharegpt``), as token ids: the
model's own tokenizer and chat template over ShareGPT and MT-bench text
(``sim/datasets.py``), in place of random ids.

- ``short_prompts``: ShareGPT first human turns (vLLM's filter), each as a one-message chat;
- ``dialogues``: ShareGPT conversations with at least ``turns`` human turns (their user
  turns, in order), for multi-turn workloads whose answers the model writes itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.datasets import load_sharegpt, sample_sharegpt


def add_model_options(parser: argparse.ArgumentParser, sharegpt_help: str) -> None:
    """``--model`` (a .gguf, folder or packaged name) and ``--dataset random|sharegpt``."""
    parser.add_argument("--model", help="a .gguf, folder or packaged name (default: bench model)")
    parser.add_argument(
        "--dataset", choices=("random", "sharegpt"), default="random", help=sharegpt_help
    )


def chosen_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Path | None:
    """The path of ``--model`` (None: the bench's own model); sharegpt needs a real one."""
    if args.dataset != "random" and not args.model:
        parser.error("--dataset sharegpt needs --model (a real tokenizer)")
    if not args.model:
        return None
    from models.pretrained import resolve_model

    return resolve_model(args.model)


def tokenizer(model: str) -> Any:
    from models.pretrained import resolve_model
    from models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model))


def chat_ids(tok: Any, text: str) -> list[int]:
    """One user message, rendered by the chat template with the assistant's turn opened."""
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    return list(tok.encode(prompt, add_special_tokens=False))


def turn_ids(tok: Any, text: str) -> list[int]:
    """A later user turn, appended to a context that ends in the model's answer: the
    template of ``[user, assistant, user]`` less that of ``[user, assistant]``."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = tok.apply_chat_template(base, add_generation_prompt=False)
    after = tok.apply_chat_template([*base, {"role": "user", "content": text}])
    if not after.startswith(before):
        raise ValueError("the chat template does not render a conversation as its prefix")
    # the answer's own tokens carry no end-of-turn marker: it starts the appended text
    end = before[before.rindex("y") + 1 :]
    return list(tok.encode(end + after[len(before) :], add_special_tokens=False))


def short_prompts(tok: Any, count: int, seed: int) -> list[list[int]]:
    reqs = sample_sharegpt(count, tok.encode, seed=seed)
    return [chat_ids(tok, r.prompt) for r in reqs]


def dialogues(turns: int, count: int, seed: int, max_chars: int = 4000) -> list[list[str]]:
    """``count`` conversations' first ``turns`` user turns (each under ``max_chars``), taken
    in order from the shipped file after a seeded start."""
    import random

    records = load_sharegpt()
    start = random.Random(seed).randrange(len(records))
    out: list[list[str]] = []
    for k in range(len(records)):
        conv = records[(start + k) % len(records)].get("conversations") or []
        users = [t["value"] for t in conv if t.get("from") == "human"]
        if len(users) >= turns and all(0 < len(u) <= max_chars for u in users[:turns]):
            out.append(users[:turns])
            if len(out) == count:
                return out
    raise ValueError(f"ShareGPT has {len(out)} conversations of {turns} user turns, not {count}")
