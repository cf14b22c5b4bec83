"""Compute kernels: paged attention, attention-state merging, RoPE, RMSNorm, MoE routing.

Kept free of side effects on purpose: Hugging Face ``transformers`` imports a package named
``kernels`` when the repository root is on ``sys.path``. Import submodules explicitly.
"""
