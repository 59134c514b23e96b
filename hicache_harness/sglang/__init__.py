"""SGLang 0.5.23 as a harness: its scheduler functions and pools on CPU, a stand-in forward
(`server`), the CPU import environment (`env`) and deterministic KV bytes (`kv_bytes`)."""
