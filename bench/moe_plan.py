"""Simulated (performance model, not measured): MegaScale-Infer's disaggregated MoE decoding
against a colocated tensor-parallel replica, and the micro-batch ablation, next to the
paper's figures. The numbers and the table are ``sim/report_moe.py``'s, the section
``python -m sim moe`` puts into ``docs/sim_report.md``; this prints it.

  python bench/moe_plan.py
"""

from __future__ import annotations

from sim.report_moe import moe_section


def main() -> None:
    print("\n".join(moe_section()))


if __name__ == "__main__":
    main()
