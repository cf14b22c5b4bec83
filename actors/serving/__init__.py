"""The Ray Serve application: ingress, router, replicas, config, metrics."""
