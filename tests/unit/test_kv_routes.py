"""KV moved between differently sharded prefill and decode workers lands exactly where the
decode workers' caches hold it: every (layer, head, block, token) once, nothing else."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from actors.disagg.kv_routes import KVTarget, piece_ranges, sent_heads
from models.sharding import kv_head_range, layer_range
from store.transfer import Endpoint

LAYERS, BS, D, ELEM = 4, 4, 3, 8  # float64


def workers(tp: int, spp: int, heads: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """(tp rank, layers, heads) of each worker of a layout."""
    return [
        (t, layer_range(LAYERS, spp, s), kv_head_range(heads, tp, t))
        for s, t in itertools.product(range(spp), range(tp))
    ]


@pytest.mark.parametrize(
    ("heads", "prefill", "decode"),
    [
        (2, (1, 1), (1, 1)),
        (2, (1, 2), (2, 1)),  # prefill stages -> decode TP ranks
        (2, (2, 1), (1, 2)),
        (4, (2, 2), (4, 1)),
        (1, (2, 1), (1, 1)),  # one KV head replicated on two prefill ranks
        (1, (1, 1), (2, 2)),  # ... and on two decode ranks
    ],
)
def test_every_piece_lands_once_where_the_decode_worker_holds_it(heads, prefill, decode):
    rng = np.random.default_rng(0)
    nb_src, nb_dst = 6, 5
    full = rng.standard_normal((LAYERS, 2, nb_src, BS, heads, D))  # the prefill's KV
    src_blocks, dst_blocks = [4, 1, 2], [0, 3, 2]
    p_workers = workers(*prefill, heads)
    d_workers = workers(*decode, heads)
    targets, segments = [], []
    for i, (_, layers, hs) in enumerate(d_workers):
        t = KVTarget(Endpoint(f"d{i}", "n"), layers, hs, nb_dst, BS, D * ELEM)
        targets.append(t)
        segments.append(np.zeros(2 * (layers[1] - layers[0]) * nb_dst * t.piece_bytes, np.uint8))
    written = [np.zeros(len(s), int) for s in segments]
    ranges = [hs for _, _, hs in p_workers[: prefill[0]]]
    for tp_rank, layers, held in p_workers:
        sent = sent_heads(held, tp_rank, ranges)
        for layer in range(*layers):
            k = np.ascontiguousarray(full[layer, 0, :, :, held[0] : held[1]])
            v = np.ascontiguousarray(full[layer, 1, :, :, held[0] : held[1]])
            local = np.concatenate([k.view(np.uint8).ravel(), v.view(np.uint8).ravel()])
            piece = k[0].nbytes
            for t, seg, w in zip(targets, segments, written, strict=True):
                for remote, off, n in piece_ranges(
                    t, layer, held, sent, piece, k.nbytes, src_blocks, dst_blocks
                ):
                    seg[remote : remote + n] = local[off : off + n]
                    w[remote : remote + n] += 1
    for t, seg, w in zip(targets, segments, written, strict=True):
        nl = t.layers[1] - t.layers[0]
        nh = t.heads[1] - t.heads[0]
        got = seg.view(np.float64).reshape(nl, 2, nb_dst, BS, nh, D)
        cover = w.reshape(nl, 2, nb_dst, -1)
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            want = full[t.layers[0] : t.layers[1], :, s, :, t.heads[0] : t.heads[1]]
            assert np.array_equal(got[:, :, d], want)
            assert (cover[:, :, d] == 1).all()  # each byte written exactly once
        untouched = [b for b in range(nb_dst) if b not in dst_blocks]
        assert (cover[:, :, untouched] == 0).all()


def test_replicated_heads_are_sent_by_the_lowest_rank_only():
    ranges = [kv_head_range(1, 4, r) for r in range(4)]
    assert [sent_heads(ranges[r], r, ranges) for r in range(4)] == [(0, 1), (0, 0), (0, 0), (0, 0)]
    ranges = [kv_head_range(4, 2, r) for r in range(2)]
    assert [sent_heads(ranges[r], r, ranges) for r in range(2)] == [(0, 2), (2, 4)]
