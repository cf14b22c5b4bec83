"""The tiny model's tokenizer: byte-level BPE over the 256-byte alphabet, built offline.

Ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, 3..258 the bytes 0..255 (GPT-2 byte-to-unicode
symbols), then ``<|reserved_i|>`` special tokens up to ``vocab_size``, so every model id
decodes. No merges: one token per byte. Encoding with special tokens prepends ``<s>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode symbols."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes, strict=True)}


def build_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(f"the tiny tokenizer needs vocab_size >= {base}, got {vocab_size}")
    symbols = byte_to_unicode()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - base)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[symbols[b]] = len(vocab)
    for tok in reserved:
        vocab[tok] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # BOS comes from the tokenizer itself, so every consumer (ours, HF's fast tokenizer) adds it
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", SPECIAL_TOKENS.index("<s>"))]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)]
    )
    return tokenizer


def write_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    build_tiny_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
