"""The torch backend and the tiny model on CUDA equal the CPU reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from models import load_model, write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tiny_model_cuda_equals_cpu(tmp_path, kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = write_tiny_model(tmp_path / kind, kind=kind)
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device in ("cpu", "cuda"):
        model = load_model(model_dir, torch.float32, device)
        cfg = model.config
        caches = allocate_kv_cache(
            cfg.num_hidden_layers,
            16,
            4,
            cfg.num_key_value_heads,
            cfg.head_dim,
            torch.float32,
            device,
        )
        table = [9, 2, 11, 0, 5, 7, 13, 1]
        outs, pos = [], 0
        for chunk in (1, 3, 16, 10):
            meta = AttentionMetadata.build([chunk], [pos + chunk], [table], 4, device=device)
            hidden = model(
                ids[pos : pos + chunk].to(device),
                torch.arange(pos, pos + chunk, device=device),
                caches,
                meta,
            )
            outs.append(model.compute_logits(hidden).cpu())
            pos += chunk
        logits[device] = torch.cat(outs)
    torch.testing.assert_close(logits["cuda"], logits["cpu"], rtol=1e-4, atol=1e-4)
