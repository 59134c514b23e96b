"""hicache-cp: the host-memory (L2) tier of the KV cache for prefill servers."""

__version__ = "0.1.0"
