"""The pretrained SmolLM2-135M-Instruct (its GGUF file, dequantized) on CUDA in bfloat16 and
float16: our engine's greedy tokens equal transformers' on the same device and dtype, with
every step eager and with pure-decode steps replayed as CUDA graphs, at batch 1 and 4.

transformers runs the same weights in the same dtype, teacher-forced on our tokens, so at
every position both have seen the same prefix. Where the two pick different tokens, half
precision's rounding flipped a near-tie: the gap in transformers' logits must be under
``TIE[dtype]``. Skipped without CUDA or without the model's package."""

from __future__ import annotations

import pytest
import torch

from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from models.hf_reference import hf_pretrained

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 32
# logit gaps a half-precision flip may have: an ulp of a logit near 16 is 0.125 in bfloat16
# (7 mantissa bits), 0.0156 in float16 (10); two summation orders differ by a few ulps
TIE = {torch.bfloat16: 0.5, torch.float16: 0.0625}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers and say why each is prime.",
]


def generate(engine: ReplicaController, prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Greedy tokens of ``prompts``, ``batch`` of them decoding together."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    builder = engine.request_builder()
    outs = []
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(builder.build(p, params)) for p in prompts[i : i + batch]]
        while engine.has_unfinished():
            engine.step()
        outs += [engine.release(r).token_ids for r in ids]
    return outs


@pytest.mark.parametrize("batch", [1, 4], ids=["batch1", "batch4"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_greedy_tokens_equal_transformers_on_cuda(smollm2_gguf, dtype, cuda_graphs, batch):
    engine = ReplicaController.build(
        str(smollm2_gguf),
        dtype=dtype,
        device="cuda",
        attention_backend="torch",
        cuda_graphs=cuda_graphs,
    )
    assert engine.device.type == "cuda"
    tok = engine.tokenizer
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    outs = generate(engine, prompts, batch)

    model = hf_pretrained(smollm2_gguf).to(device="cuda", dtype=dtype)
    flips = []
    for prompt, got in zip(prompts, outs, strict=True):
        assert len(got) == NEW_TOKENS
        seq = torch.tensor([prompt + got[:-1]], device="cuda")
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1 :].float()  # [NEW_TOKENS, vocab]
        want = logits.argmax(-1).tolist()
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                gap = (logits[k, b] - logits[k, a]).item()
                flips.append((k, gap))
                assert gap < TIE[dtype], f"token {k}: ours {a}, transformers {b} (gap {gap:.3f})"
    mode = "graphs" if cuda_graphs else "eager"
    total = NEW_TOKENS * len(prompts)
    print(f"{dtype} {mode} batch {batch}: {len(flips)} of {total} tokens differ: {flips}")
