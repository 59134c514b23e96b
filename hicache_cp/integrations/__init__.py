"""Glue that plugs hicache-cp into serving engines; each engine in its own folder.

    sglang   an SGLang L3 storage backend over hicache-cp's Mooncake Store adapter
    vllm     a vLLM KV connector: hicache-cp as the host tier of a vLLM server

Nothing here is imported by the library itself; each plug-in imports its
engine only when it is loaded by that engine.
"""
