"""Our CausalLM against Hugging Face transformers on the same tiny checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from models import load_model, write_tiny_model

torch.set_num_threads(2)

BLOCK = 4
VARIANTS = {
    "llama": dict(kind="dense"),
    "llama_tied": dict(kind="dense", tie_word_embeddings=True),
    "llama_bias_linear_rope": dict(
        kind="dense", attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "qwen2": dict(kind="dense", architectures=["Qwen2ForCausalLM"], rope_scaling=None),
    "mistral": dict(kind="dense", architectures=["MistralForCausalLM"], sliding_window=None),
    "mixtral": dict(kind="moe"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: write_tiny_model(tmp_path_factory.mktemp(name), seed=i, **kw)
        for i, (name, kw) in enumerate(VARIANTS.items())
    }


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


class Runner:
    """Drives our model over a paged cache the way an engine does: steps of chunks."""

    def __init__(self, model, num_blocks=64, seed=0):
        cfg = model.config
        self.model = model
        self.caches = allocate_kv_cache(
            cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim
        )
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step with ``chunks[seq] = new token ids``; logits of every new token."""
        query_lens, ctx_lens, tables, ids, positions = [], [], [], [], []
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK < start + len(toks):
                table.append(self.free.pop())
            self.lens[seq] = start + len(toks)
            query_lens.append(len(toks))
            ctx_lens.append(start + len(toks))
            tables.append(list(table))
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
        meta = AttentionMetadata.build(query_lens, ctx_lens, tables, BLOCK)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        out, row = {}, 0
        for seq, n in zip(chunks, query_lens, strict=True):
            out[seq] = logits[row : row + n]
            row += n
        return out


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf_whole_and_chunked(checkpoints, variant):
    model_dir = checkpoints[variant]
    ids = prompt(37, seed=1)
    ref = hf_logits(model_dir, ids)
    assert ref.std() > 0.5  # logits are spread out: greedy decisions are not near-ties
    model = load_model(model_dir)
    whole = Runner(model).step({"a": ids})["a"]
    assert_logits_close(whole, ref)
    runner, pieces, pos = Runner(model, seed=5), [], 0
    for size in [1, 3, 16, math.inf]:
        n = int(min(size, len(ids) - pos))
        pieces.append(runner.step({"a": ids[pos : pos + n]})["a"])
        pos += n
    assert_logits_close(torch.cat(pieces), ref)


@pytest.mark.parametrize("variant", ["llama", "mixtral"])
def test_mixed_batch_of_chunks_and_decodes_matches_hf(checkpoints, variant):
    model_dir = checkpoints[variant]
    a, b, c = prompt(20, 2), prompt(13, 3), prompt(6, 4)
    ref_a, ref_b, ref_c = (hf_logits(model_dir, p) for p in (a, b, c))
    runner = Runner(load_model(model_dir), seed=9)
    s1 = runner.step({"a": a[:7], "b": b, "c": c[:1]})
    s2 = runner.step({"a": a[7:], "c": c[1:2]})
    s3 = runner.step({"c": c[2:]})
    assert_logits_close(torch.cat([s1["a"], s2["a"]]), ref_a)
    assert_logits_close(s1["b"], ref_b)
    assert_logits_close(torch.cat([s1["c"], s2["c"], s3["c"]]), ref_c)


def test_greedy_decode_matches_hf_generate(checkpoints):
    model_dir = checkpoints["llama"]
    ids = prompt(9, 6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    runner = Runner(load_model(model_dir))
    logits = runner.step({"a": ids})["a"][-1]
    got = []
    for _ in range(12):
        token = int(logits.argmax())
        got.append(token)
        logits = runner.step({"a": [token]})["a"][-1]
    assert got == expected


def test_multi_shard_loading_equals_single_shard(tmp_path):
    single = load_model(write_tiny_model(tmp_path / "one", kind="moe"))
    sharded_dir = write_tiny_model(tmp_path / "three", kind="moe", num_shards=3)
    assert len(list(sharded_dir.glob("*.safetensors"))) == 3
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded = load_model(sharded_dir)
    for (name, p1), (_, p2) in zip(
        single.named_parameters(), sharded.named_parameters(), strict=True
    ):
        assert torch.equal(p1, p2), name


def test_sharded_checkpoint_loads_in_hf(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", kind="dense", num_shards=2)
    ids = prompt(10, 7)
    assert_logits_close(
        Runner(load_model(model_dir)).step({"a": ids})["a"], hf_logits(model_dir, ids)
    )


def test_tied_embeddings_share_storage(checkpoints):
    model = load_model(checkpoints["llama_tied"])
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_load_in_bfloat16(checkpoints):
    model = load_model(checkpoints["llama"], dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rope.cos.dtype == torch.float32
    ids = prompt(12, 8)
    cfg = model.config
    caches = allocate_kv_cache(
        cfg.num_hidden_layers, 8, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16
    )
    meta = AttentionMetadata.build([12], [12], [[0, 1, 2]], BLOCK)
    hidden = model(torch.tensor(ids), torch.arange(12), caches, meta)
    logits = model.compute_logits(hidden)
    ref = hf_logits(checkpoints["llama"], ids)
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()
