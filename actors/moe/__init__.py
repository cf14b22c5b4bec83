"""Attention/expert disaggregation of MoE models (MegaScale-Infer): attention workers,
expert workers, the M2N/N2M messages between them and the executors that run the ping-pong
pipeline of micro-batches, in process or as Ray actors over a compiled graph."""
