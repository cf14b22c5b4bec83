"""Logprobs a trainer can trust: Meridian's sampled tokens' logprobs against a trainer's own
forward pass over the same tokens, across weight updates pushed in place.

A Ray cluster on this machine holds a trainer actor (the model in torch, as Hugging Face
``transformers`` loads it from the same folder) and ``LLM(model, num_replicas=2)``'s
replica actors. Each round: the replicas sample ``--max-tokens`` tokens for every prompt
(temperature 1, a fixed seed per prompt, ``logprobs=0``: each sampled token's logprob under
the model's raw log-softmax); the trainer recomputes those logprobs with its forward pass
over prompt + sampled tokens; the table row is the max and mean absolute difference over
every sampled token. Then the trainer takes one policy-gradient step (REINFORCE on the
samples with a ±1 reward per sample, plain SGD, ``--lr``) and returns its new weights,
Hugging Face-named, as an object ref; ``LLM.update_weights(ref)`` loads them into both
replicas (each reads them from the object store), timed. How far the step moved the
trainer's own logprobs of those tokens is printed too: a match in the next round shows
the engine runs the new weights only if that shift is well above the differences. Round 0
runs on the stored weights; ``--updates`` more follow. The whole run repeats per
``--dtypes`` (engine and trainer in that dtype).

Prompts: ShareGPT first turns in the model's chat template with ``--dataset sharegpt``
(needs a real tokenizer: ``--model`` a .gguf, folder or packaged name; a .gguf is written
out as a Hugging Face folder first, which the trainer loads), else random ids on the tiny
model.

    python bench/rollout_logprobs.py --model SmolLM2-135M-Instruct --dataset sharegpt
    python bench/rollout_logprobs.py                     # the tiny model, a quick check

Last line: ``rollout logprobs fp32 max |meridian - trainer|: <x>`` (the worst round;
target <= 1e-4).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from actors import LLM, SamplingParams
from bench.local_serve import local_ray
from models.weight_update import SharedWeights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Trainer:
    """The model in torch, as a trainer holds it: recomputes logprobs, takes SGD steps."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        from models.hf_reference import hf_pretrained

        torch.manual_seed(0)
        self.model = hf_pretrained(model_dir).to(DTYPES[dtype])
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def _logprobs(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens)]: log p(tokens[i] | prompt + tokens[:i])."""
        ids = torch.tensor([prompt + tokens])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]

    def logprobs(self, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
        with torch.inference_mode():
            return [self._logprobs(p, o).tolist() for p, o in zip(prompts, outputs, strict=True)]

    def step(
        self, prompts: list[list[int]], outputs: list[list[int]], rewards: list[float], lr: float
    ) -> SharedWeights:
        """One REINFORCE step; returns every weight under its Hugging Face name, as the
        object store shares it (each replica reads the one copy)."""
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.zero_grad()
        loss = sum(
            -r * self._logprobs(p, o).sum()
            for p, o, r in zip(prompts, outputs, rewards, strict=True)
        ) / len(prompts)
        loss.backward()  # type: ignore[union-attr]
        self.optim.step()
        return SharedWeights.of(self.model.state_dict())


def hf_folder(model: str | None, work: Path) -> Path:
    """A Hugging Face folder of ``model`` (the trainer loads it; the engine too)."""
    from models import tiny_model_dir
    from models.gguf_checkpoint import is_gguf
    from models.gguf_convert import convert_gguf
    from models.pretrained import resolve_model

    if model is None:
        return tiny_model_dir("dense")
    path = resolve_model(model)
    return convert_gguf(path, work / "hf") if is_gguf(path) else path


def prompt_ids(folder: Path, dataset: str, count: int, seed: int) -> list[list[int]]:
    if dataset == "sharegpt":
        from bench.real_prompts import short_prompts, tokenizer  # noqa: PLC0415

        return short_prompts(tokenizer(str(folder)), count, seed)
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 40))] for _ in range(count)]


def run(
    args: argparse.Namespace, folder: Path, dtype: str
) -> list[tuple[int, float, float, float]]:
    """(round, max |diff|, mean |diff|, seconds of the update before it) per round."""
    import ray

    prompts = prompt_ids(folder, args.dataset, args.prompts, args.seed)
    trainer: Any = ray.remote(Trainer).remote(str(folder), dtype)
    llm = LLM(folder, num_replicas=args.replicas, dtype=DTYPES[dtype], kv_cache_memory=1 << 27)
    rows = []
    update_s = math.nan
    try:
        for rnd in range(args.updates + 1):
            params = [
                SamplingParams(
                    max_tokens=args.max_tokens,
                    min_tokens=args.max_tokens,
                    temperature=1.0,
                    seed=args.seed * 1000 + 17 * rnd + i,
                    logprobs=0,
                )
                for i in range(len(prompts))
            ]
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            tokens = [o.token_ids for o in outs]
            theirs = ray.get(trainer.logprobs.remote(prompts, tokens))
            diffs = [
                abs(mine.logprob - ref)
                for o, t in zip(outs, theirs, strict=True)
                for mine, ref in zip(o.logprobs or [], t, strict=True)
            ]
            rows.append((rnd, max(diffs), sum(diffs) / len(diffs), update_s))
            print(
                f"  {dtype} round {rnd}: max {rows[-1][1]:.3g} mean {rows[-1][2]:.3g} "
                f"over {len(diffs)} tokens; update before it {update_s:.2f} s",
                flush=True,
            )
            if rnd == args.updates:
                break
            rng = random.Random(rnd)
            rewards = [rng.choice((-1.0, 1.0)) for _ in prompts]
            ref = trainer.step.remote(prompts, tokens, rewards, args.lr)
            ray.wait([ref])  # the step's own time is not the update's
            began = time.perf_counter()
            llm.update_weights(ref)
            update_s = time.perf_counter() - began
            # how far the step moved these tokens' logprobs: a match after it means the
            # engine runs the new weights only if this is well above the differences
            moved = ray.get(trainer.logprobs.remote(prompts, tokens))
            shift = max(
                abs(a - b)
                for x, y in zip(moved, theirs, strict=True)
                for a, b in zip(x, y, strict=True)
            )
            print(f"  {dtype} update {rnd + 1} moved the trainer's logprobs by up to {shift:.3g}")
    finally:
        llm.close()
        ray.kill(trainer)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .gguf, folder or packaged name (default: tiny model)")
    ap.add_argument("--dataset", choices=("random", "sharegpt"), default="random")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.dataset == "sharegpt" and not args.model:
        ap.error("--dataset sharegpt needs --model (a real tokenizer)")

    with local_ray(num_cpus=4):
        with tempfile.TemporaryDirectory() as tmp:
            folder = hf_folder(args.model, Path(tmp))
            print(
                f"rollout-logprobs: {folder.name}; {args.prompts} prompts ({args.dataset}), "
                f"{args.max_tokens} tokens each, {args.updates} updates, {args.replicas} replicas",
                flush=True,
            )
            results = {dtype: run(args, folder, dtype) for dtype in args.dtypes}
    print("\n| dtype | round | max abs diff | mean abs diff | update before it (s) |")
    print("|---|---|---|---|---|")
    for dtype, rows in results.items():
        for rnd, mx, mean, secs in rows:
            print(f"| {dtype} | {rnd} | {mx:.3g} | {mean:.3g} | {secs:.2f} |")
    if "fp32" in results:
        worst = max(mx for _, mx, _, _ in results["fp32"])
        print(f"rollout logprobs fp32 max |meridian - trainer|: {worst:.3g}")


if __name__ == "__main__":
    main()
