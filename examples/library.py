"""hicache-cp as a library: the protocol of one request, and an L2 hit.

    python examples/library.py

A prefill server calls the cache around its forward as `serve` does; the loop over
layers stands where the model computes each layer and writes its KV into the L1
pages. Runs on CPU (the tiny model preset, host-memory L1, the `cpu` copy engine).
"""

from __future__ import annotations

import numpy as np

from hicache_cp import Config, HiCache, Model


def serve(cache: HiCache, tokens: np.ndarray) -> tuple[int, int]:
    """One request through the cache; returns (L1 hit pages, L2 hit pages)."""
    pages = len(tokens) // cache.config.page_size
    m = cache.match_prefix(tokens)                    # L1 prefix + committed L2 continuation, locked
    load = cache.load_back(m)                         # H2D per layer into fresh L1 pages (or None)
    new = cache.alloc_device(pages - m.matched_pages, m.matched_pages)
    backup = cache.reserve_backup(new, m.matched_pages)   # write-through: L2 reserved, invisible
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(cache.layout.num_layers(model)):
            if load:
                load.wait_layer(layer, model)         # the forward waits per layer
            ...                                       # compute the layer, write KV of `new` into L1
            cache.on_layer_end(model, layer, [backup])    # D2H of that layer starts now
    node = cache.insert(m, new, backup=backup)        # pages join the tree
    cache.poll()                                      # agreed acks -> commit (all parts, all ranks)
    cache.release(node)
    cache.settle()                                    # end-of-forward sync: decide what is in flight
    cache.ensure_free()                               # back to the free-room targets
    return m.device_len, m.host_len


def main() -> dict[str, int]:
    config = Config(model="tiny", l1_pages=256, host_budget_bytes=64 << 20)
    with HiCache(config) as cache:
        prompt = np.arange(160)                       # 10 pages of 16 tokens
        first = serve(cache, prompt)                  # a miss: computed, backed up to L2
        second = serve(cache, prompt)                 # an L1 hit
        cache.evict_device()                          # L1 pressure: the copy stays in L2
        third = serve(cache, prompt)                  # an L2 hit, loaded back layer by layer
        print(f"miss {first}, L1 hit {second}, L2 hit {third} (L1 pages, L2 pages)")
        cache.check_invariants()
        return {"first_l1": first[0], "first_l2": first[1], "second_l1": second[0], "third_l2": third[1],
                "backups_committed": cache.metrics.backups_committed}


if __name__ == "__main__":
    main()
