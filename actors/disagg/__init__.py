"""Prefill/decode disaggregation: prefill and decode replicas, the Conductor, KV streaming."""
