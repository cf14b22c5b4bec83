"""Regions of replicas, each behind its own balancer (SkyWalker): the live runtime."""
