"""Decode speed on one GPU against the memory-bandwidth limit and transformers' generate.

The pretrained SmolLM2-135M-Instruct (GGUF, dequantized) in bfloat16, the in-process engine
(torch attention backend), once per ``--modes`` entry: ``eager`` (every step eager,
``cuda_graphs=False``), ``graphs`` (pure-decode steps replayed as CUDA graphs, one per
batch-size bucket, ``cuda_graphs=True``; actors/engine/decode_graphs.py) and ``overlap``
(graphs, and each step's host work done while the previous step runs, ``overlap_steps=True``;
actors/engine/token_feed.py), side by side.
For each batch: prompts of ``--prompt-len`` random tokens, ``--new-tokens`` greedy tokens
each. A decode step's time = (time of an N-token generate - time of a 1-token generate) /
(N - 1), the same for transformers' ``generate`` on the same model, dtype and batch; the
sides interleaved, medians of ``--repeats``. A warm-up of N tokens first (graphs are
captured there, not in the timed runs). The other modes' tokens are checked against the
``eager`` mode's on the warm-up (a line says where they differ).

HBM fraction = bytes a decode step must read (every weight once, plus the batch's KV cache at
its mean context) / step time / the device's copy bandwidth, measured in the same run (a
device-to-device copy, bytes read plus written).

``--profile``: then the Python profile (cProfile, by own time) of 32 decode steps at batch
``--profile-batch`` (default 1; of the last mode), to show where a step spends its host
time.

    python bench/decode_gpu.py [--batches 1 32 256] [--prompt-len 128] [--new-tokens 64]
        [--modes eager graphs overlap]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from actors import LLM, SamplingParams
from bench.interleave import interleaved
from models.hf_reference import hf_generate, hf_pretrained
from models.pretrained import resolve_model


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


MODES = {  # mode -> its engine options
    "eager": {"cuda_graphs": False},
    "graphs": {"cuda_graphs": True},
    "overlap": {"cuda_graphs": True, "overlap_steps": True},
}


def generate_ours(llm: LLM, prompts: list[list[int]], k: int) -> list[list[int]]:
    llm.engine.kv.evict_all_cached()  # no prefix hits between repeats
    p = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=p)
    assert all(len(o.token_ids) == k for o in outs)
    return [o.token_ids for o in outs]


@dataclass(frozen=True)
class Column:
    """One side's figures at one batch size."""

    step_s: float  # median seconds per decode step

    def cells(self, batch: int, step_bytes: float, bandwidth: float, hf_step_s: float) -> str:
        """ms/step, tok/s, HBM fraction, step time over transformers' (target <= 0.2)."""
        s = self.step_s
        return (
            f"{s * 1e3:>9.2f} {batch / s:>8.0f} {step_bytes / s / bandwidth:>6.1%} "
            f"{s / hf_step_s:>6.2f}"
        )


def header(modes: list[str]) -> str:
    cols = "".join(f" | {m + ' ms':>9} {'tok/s':>8} {'HBM':>6} {'/HF':>6}" for m in modes)
    return f"{'batch':>5}{cols} | {'HF ms':>8} {'tok/s':>8} {'HBM':>6}"


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """Positions where two runs' greedy tokens differ, over every sequence."""
    return sum(x != y for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=1)
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    args = ap.parse_args()

    dtype = torch.bfloat16
    path = resolve_model(args.model)
    bandwidth = copy_bandwidth()
    engines = {
        mode: LLM(
            str(path),
            device="cuda",
            dtype=dtype,
            attention_backend="torch",
            kv_cache_memory=8 << 30,
            max_num_seqs=max(args.batches),
            token_budget=8192,
            **MODES[mode],
        )
        for mode in args.modes
    }
    hf = hf_pretrained(path).to(device="cuda", dtype=dtype)
    cfg = hf.config
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"model: {args.model}, {weight_bytes / 1e6:.0f} MB of weights in {dtype}")
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.repeats} repeats")
    print("per mode: ms per decode step, tokens/s, HBM fraction, step time / transformers'")
    print(header(args.modes))
    rng = random.Random(0)
    n = args.new_tokens
    for b in args.batches:
        prompts = [
            [rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(b)
        ]
        sides = {m: partial(generate_ours, llm, prompts) for m, llm in engines.items()}
        sides["hf"] = partial(hf_generate, hf, torch.tensor(prompts, device="cuda"))
        warm = {m: sides[m](n) for m in engines}  # captures every graph the timed runs use
        sides["hf"](2)
        for mode in warm:
            diff = differing(warm["eager"], warm[mode]) if "eager" in warm else 0
            if diff:
                print(f"batch {b}: {mode}'s greedy tokens differ from eager's at {diff} of {b * n}")

        def step(name: str, _repeat: int, sides: dict = sides) -> float:
            fn = sides[name]
            t1, tn = timed(lambda: fn(1)), timed(lambda: fn(n))
            return (tn - t1) / (n - 1)

        steps = interleaved(list(sides), args.repeats, step, rotate=False)  # A, B, A, B, ...
        step_bytes = weight_bytes + b * (args.prompt_len + n / 2) * kv_bytes_per_token
        h = statistics.median(steps["hf"])
        cells = "".join(
            " | " + Column(statistics.median(steps[m])).cells(b, step_bytes, bandwidth, h)
            for m in args.modes
        )
        print(f"{b:>5}{cells} | {h * 1e3:>8.2f} {b / h:>8.0f} {step_bytes / h / bandwidth:>6.1%}")

    if args.profile:
        prompts = [
            [rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)]
            for _ in range(args.profile_batch)
        ]
        profile_decode(engines[args.modes[-1]].engine, prompts)


def profile_decode(engine, prompts: list[list[int]], steps: int = 32) -> None:
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    builder = engine.request_builder()
    rids = [engine.add_request(builder.build(prompt, params)) for prompt in prompts]
    while min(len(engine.output(rid).token_ids) for rid in rids) < 2:
        engine.step()  # every prompt's prefill, then pure decode steps only
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"profiled {steps} decode steps at batch {len(prompts)}: {ms:.2f} ms/step")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.release(rid)


if __name__ == "__main__":
    main()
