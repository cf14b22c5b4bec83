"""GPU specifications for the roofline cost model.

Dense BF16 tensor-core peak (no sparsity), HBM bandwidth and capacity per GPU. Prices are
relative, normalised so that one L20 costs 1.0, as in MegaScale-Infer Table 3; the GPUs that
table lists (L20, H800, A800, H20, L40S) carry its figures, the others are our estimates
(marked) from list-price ratios. ``link_bw`` is the per-GPU intra-node interconnect used by
tensor-parallel all-reduce (NVLink, or PCIe for the L-series).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class GPUSpec:
    name: str
    flops: float  # dense BF16 FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float  # HBM capacity in bytes
    price: float  # relative cost, L20 = 1.0
    link_bw: float  # intra-node bytes/s per GPU (tensor-parallel all-reduce)
    price_estimated: bool = False


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("A100", 312 * TFLOPS, 2039 * GB, 80 * GB, 2.26, 300 * GB, price_estimated=True),
        GPUSpec("A800", 312 * TFLOPS, 2039 * GB, 80 * GB, 2.26, 200 * GB),
        GPUSpec("H100", 989 * TFLOPS, 3350 * GB, 80 * GB, 5.28, 450 * GB, price_estimated=True),
        GPUSpec("H800", 989 * TFLOPS, 3430.4 * GB, 80 * GB, 5.28, 200 * GB),
        GPUSpec("H200", 989 * TFLOPS, 4800 * GB, 141 * GB, 6.0, 450 * GB, price_estimated=True),
        GPUSpec("L20", 119.5 * TFLOPS, 864 * GB, 48 * GB, 1.00, 32 * GB),
        GPUSpec("L40S", 362 * TFLOPS, 864 * GB, 48 * GB, 1.08, 32 * GB),
        GPUSpec("H20", 148 * TFLOPS, 4096 * GB, 96 * GB, 1.85, 450 * GB),
        # The machine the live CPU engine runs on: a placeholder the fitted predictor replaces.
        GPUSpec("CPU", 0.05 * TFLOPS, 8.5 * GB, 24 * GB, 0.1, 8.5 * GB, price_estimated=True),
    ]
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.upper() if name.upper() in GPUS else name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
