"""Engine throughput on CPU against Hugging Face transformers' generate, same weights, one run.

A random-weight Llama-style model of 8 layers, hidden 512 (written in HF format), fp32.
Prefill tokens/s = prompt tokens / time of a 1-token generate; decode tokens/s = generated
tokens after the first / (time of an N-token generate - time of the 1-token generate).
Targets: decode at batch 32 >= 2x transformers; at batch 1 >= 0.8x.

Two workloads. "uniform": every prompt 128 tokens, every request 64 new tokens: a pure
per-step efficiency comparison. "mixed" (batch 32 only): prompt lengths uniform in
[16, 240] and output lengths uniform in [8, 128], as a server sees them; transformers'
static batch left-pads the prompts and runs until the longest output is done, our engine
batches continuously. Mixed reports useful (requested) tokens per second end to end.

    python bench/engine_cpu.py [--prompt-len 128] [--new-tokens 64] [--batches 1 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from actors import LLM, SamplingParams
from bench.bench_model import MODEL, write_bench_model
from bench.interleave import seconds_in_turns
from models.hf_reference import hf_generate, hf_pretrained


def pick(times: list[float]) -> float:
    """The best of fewer than three runs, else their median."""
    return min(times) if len(times) < 3 else statistics.median(times)


def ours(llm: LLM, prompts: list[list[int]]) -> Callable[[int], None]:
    """An n-token generate of ``prompts`` on our engine."""

    def run(n: int) -> None:
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.engine.kv.evict_all_cached()  # no prefix hits between repeats
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=p)
        assert all(len(o.token_ids) == n for o in outs)

    return run


def hf(model, prompts: list[list[int]]) -> Callable[[int], None]:
    """An n-token generate of ``prompts`` on transformers."""
    ids = torch.tensor(prompts)

    def run(n: int) -> None:
        hf_generate(model, ids, n)

    return run


def uniform(
    llm: LLM, hf_model, prompts: list[list[int]], new_tokens: int, repeats: int
) -> list[float]:
    """(ours 1-token, ours n-token, transformers 1-token, n-token) seconds, the four
    generates taking turns ``repeats`` times after a warm-up of each side."""
    run_ours, run_hf = ours(llm, prompts), hf(hf_model, prompts)
    run_ours(2)  # warm-up
    run_hf(2)
    calls: dict[str, Callable[[], None]] = {
        "ours 1": lambda: run_ours(1),
        "ours n": lambda: run_ours(new_tokens),
        "hf 1": lambda: run_hf(1),
        "hf n": lambda: run_hf(new_tokens),
    }
    return [pick(t) for t in seconds_in_turns(calls, repeats).values()]


def mixed(llm: LLM, hf_model, vocab: int, batch: int, repeats: int) -> tuple[float, float, int]:
    """Seconds for ours and for transformers to serve one mixed batch, and useful tokens."""
    rng = random.Random(1)
    lens = [rng.randint(16, 240) for _ in range(batch)]
    outs = [rng.randint(8, 128) for _ in range(batch)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]

    def run_ours():
        llm.engine.kv.evict_all_cached()
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [len(o.token_ids) for o in got] == outs

    width = max(lens)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_hf():
        with torch.inference_mode():
            hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    run_ours()
    times = seconds_in_turns({"ours": run_ours, "hf": run_hf}, repeats)
    return pick(times["ours"]), pick(times["hf"]), sum(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_bench_model(Path(tmp) / "bench")
        hf_model = hf_pretrained(model_dir)
        llm = LLM(model_dir, block_size=16, token_budget=8192, max_num_seqs=64)
        rng = random.Random(0)
        print(f"model: {MODEL}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        header = f"{'batch':>5} {'phase':>7} {'ours tok/s':>11} {'HF tok/s':>10} {'ratio':>6}"
        print(header)
        for b in args.batches:
            prompts = [
                [rng.randrange(3, MODEL["vocab_size"]) for _ in range(args.prompt_len)]
                for _ in range(b)
            ]
            o1, on, h1, hn = uniform(llm, hf_model, prompts, args.new_tokens, args.repeats)
            pre_o, pre_h = b * args.prompt_len / o1, b * args.prompt_len / h1
            dec = b * (args.new_tokens - 1)
            dec_o, dec_h = dec / (on - o1), dec / (hn - h1)
            print(f"{b:>5} {'prefill':>7} {pre_o:>11.0f} {pre_h:>10.0f} {pre_o / pre_h:>6.2f}")
            print(f"{b:>5} {'decode':>7} {dec_o:>11.0f} {dec_h:>10.0f} {dec_o / dec_h:>6.2f}")
        b = max(args.batches)
        t_ours, t_hf, useful = mixed(llm, hf_model, MODEL["vocab_size"], b, args.repeats)
        o, h = useful / t_ours, useful / t_hf
        print(f"{b:>5} {'mixed':>7} {o:>11.0f} {h:>10.0f} {o / h:>6.2f}  (useful tokens/s)")


if __name__ == "__main__":
    main()
