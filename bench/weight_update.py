"""Weights in place and memory handed back, on replica actors: how long
``LLM.update_weights`` takes, and what ``sleep`` frees and ``wake_up`` costs.

For each model (SmolLM2-135M-Instruct, written out as a Hugging Face folder, and a
random-weight model of Qwen2-0.5B's shape) and layout (``replicas``: ``LLM(folder,
num_replicas=2)``; ``pd``: ``LLM(folder, num_prefill=1, num_decode=1)``, whose decode
worker's KV cache is a shared-memory segment) on a local Ray cluster: a full set of new
weights (every tensor plus noise, fp32) is put in the object store once, as a trainer
hands it over (not timed), and ``update_weights(ref)`` is timed from the call until every
replica serves the new weights, ``--repeats`` times (median). Then ``sleep(1)`` (KV
cache), ``wake_up``, ``sleep(2)`` (KV cache and weights), ``wake_up``: bytes freed over
the replicas and seconds each; greedy tokens after the last wake equal those before the
sleeps (checked, printed).

    python bench/weight_update.py [--models smollm2 qwen2-0.5b] [--layouts replicas pd]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from actors import LLM, SamplingParams
from bench.bench_model import write_qwen2_05b
from bench.local_serve import local_ray
from models.weight_update import SharedWeights

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 8, 1000, 2024], [7, 8, 9, 10, 11, 12]]


def folder_of(name: str, work: Path) -> Path:
    if name == "qwen2-0.5b":
        return write_qwen2_05b(work / "qwen2-0.5b")
    from models.gguf_convert import convert_gguf
    from models.pretrained import pretrained_file

    return convert_gguf(pretrained_file("SmolLM2-135M-Instruct"), work / "smollm2")


def noisy_weights(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for n, t in load_file(str(f)).items():
            t = t.float()
            out[n] = t + 1e-3 * t.std() * torch.randn(t.shape, generator=gen)
    return out


def measure(name: str, folder: Path, layout: str, repeats: int) -> dict[str, float]:
    import ray

    replicas = {"num_prefill": 1, "num_decode": 1} if layout == "pd" else {"num_replicas": 2}
    llm = LLM(folder, kv_cache_memory=1 << 28, **replicas)
    row: dict[str, float] = {}
    try:
        times = []
        for r in range(repeats):
            weights = noisy_weights(folder, r)
            row["update_mb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
            ref = ray.put(SharedWeights.of(weights))
            del weights
            began = time.perf_counter()
            llm.update_weights(ref)
            times.append(time.perf_counter() - began)
            print(f"  {name} update {r + 1}: {times[-1]:.2f} s", flush=True)
        row["update_s"] = statistics.median(times)
        before = [
            o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
        ]
        for level in (1, 2):
            began = time.perf_counter()
            row[f"sleep{level}_mb"] = llm.sleep(level) / 1e6
            row[f"sleep{level}_s"] = time.perf_counter() - began
            began = time.perf_counter()
            llm.wake_up()
            row[f"wake{level}_s"] = time.perf_counter() - began
        after = [
            o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
        ]
        row["same_tokens"] = float(after == before)
    finally:
        llm.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2-0.5b"])
    ap.add_argument("--layouts", nargs="+", default=["replicas", "pd"], choices=["replicas", "pd"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with local_ray(num_cpus=4):
        rows = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                folder = folder_of(name, Path(tmp))
                for layout in args.layouts:
                    rows[name, layout] = measure(name, folder, layout, args.repeats)
    print(
        "\n| model | layout | weights (MB) | update_weights (s, median) | sleep(1) frees (MB) "
        "| wake (s) | sleep(2) frees (MB) | wake (s) | same tokens after |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, layout), r in rows.items():
        print(
            f"| {name} | {layout} | {r['update_mb']:.0f} | {r['update_s']:.2f} | "
            f"{r['sleep1_mb']:.0f} | "
            f"{r['wake1_s']:.2f} | {r['sleep2_mb']:.0f} | {r['wake2_s']:.2f} | "
            f"{'yes' if r['same_tokens'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
