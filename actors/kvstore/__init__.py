"""The KV-store shard actor and its client."""
