"""Prompts tokenize exactly as ``transformers.AutoTokenizer`` does on the same folder,
whatever ``add_bos_token`` says in ``tokenizer_config.json`` (the fast tokenizer, and so
vLLM, follows ``tokenizer.json``'s post-processor alone)."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from models import load_tokenizer, write_tiny_model

TEXTS = ["hello world", "", " leading space", "<s>already bos", "a</s>b", "héllo ünïcode 日本"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), kind="dense")


def variant(tiny, tmp_path, add_bos, post_processor, cls=None):
    d = tmp_path / "tok"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token", None)
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    if cls is not None:
        cfg["tokenizer_class"] = cls
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if not post_processor:
        tok = json.loads((d / "tokenizer.json").read_text())
        tok["post_processor"] = None
        (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


@pytest.mark.parametrize(
    "add_bos, post_processor, cls",
    [
        ("as written", True, None),
        (True, False, None),  # add_bos_token set, no post-processor: no BOS
        (False, True, None),  # add_bos_token off, a BOS post-processor: BOS
        (None, False, None),
        (True, False, "LlamaTokenizerFast"),
    ],
)
def test_encode_equals_auto_tokenizer(tiny, tmp_path, add_bos, post_processor, cls):
    d = tiny if add_bos == "as written" else variant(tiny, tmp_path, add_bos, post_processor, cls)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = load_tokenizer(d)
    for text in TEXTS:
        for special in (True, False):
            want = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == want, (text, special)
