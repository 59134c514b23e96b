"""Prefill engines that drive `HiCache` as a real server would.

    synthetic   the reference server: deterministic KV bytes, one request at a time
"""
