"""Turns one scheduled step into model inputs, runs the model and returns logits to sample.

Input layout: the step's entries are concatenated in batch order into a flat batch of T
tokens; entry b contributes tokens ``[c_b, c_b + n_b)`` of its sequence, where
``c_b = num_computed_tokens`` before the step.
"""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from policies.scheduler import ScheduledStep
from policies.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def run(
        self, step: ScheduledStep, block_tables: dict[str, list[int]]
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Returns the sequences that sample this step and their logits [N, vocab]."""
        tokens: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq, n in step.entries:
            start = seq.num_computed_tokens
            tokens.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(block_tables[seq.request_id])
            if ScheduledStep.samples(seq, n):
                sample_rows.append(len(tokens) - 1)
                samplers.append(seq)
        meta = AttentionMetadata.build(
            query_lens, context_lens, tables, self.block_size, device=self.device
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, pos, self.kv_caches, meta)
        if not samplers:
            return [], hidden.new_empty((0, 0))
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return samplers, self.model.compute_logits(hidden.index_select(0, rows))
