"""Which of SGLang's serving modes `--radix-cache-backend hicache-cp` runs in.

Checked once, when SGLang builds the tree cache (`check_modes`): a mode the
plug-in cannot serve correctly is refused at start with a `ValueError`
naming the flag, never discovered as wrong bytes later.

    mode                                   decision
    plain prefill/decode, overlap or not   supported (loads and reservations at the forward's
                                           start, on its stream; `fence`)
    prefill CUDA graphs (any backend)      supported: piecewise and breakable graphs run the pool
      --cuda-graph-backend-prefill         hooks in layer order; a full replay waits for every
                                           load before it and submits the backups after it
                                           (`layer_hooks`)
    DP attention --enable-dp-attention     supported: decisions agreed over the ranks of one DP
                                           rank (SGLang's tp_cache_group)
    speculative decoding                   supported for MTP (NextN) drafts, whose pools SGLang
      --speculative-algorithm              packs beside the target's (`drafts`); other drafts
                                           with their own KV are refused (it would be stale)
    PD prefill --disaggregation-mode       refused: SGLang's prefill result processing reads a
      prefill                              request's `discard_output_reason` before any tree-
                                           cache call and sends its KV right after the
                                           checkpoint, so a host load that failed in flight
                                           would reach the decode server before the plug-in can
                                           fail the request (hicache-cp's own PD adapter,
                                           `hicache_cp.pd`, sends from L2 instead)
    PD decode --disaggregation-mode decode refused: a decode server's KV arrives through the PD
                                           transfer, not through a forward whose layer hooks
                                           order copies; hicache-cp is the prefill server's L2
    attention CP --attn-cp-size > 1        refused: SGLang shards pages over the CP ranks, whose
                                           decisions the DP-aware group does not agree
    pipeline parallel --pp-size > 1        refused: each stage holds its own layers, and a load
                                           decision would not be agreed across stages
"""

from __future__ import annotations

from typing import Any

BACKEND_FLAG = "--radix-cache-backend hicache-cp"


def check_modes(server_args: Any) -> None:
    """Raise ValueError naming the flag of the first mode the plug-in refuses (see above)."""
    mode = str(getattr(server_args, "disaggregation_mode", "null") or "null")
    if mode == "prefill":
        raise ValueError(
            f"{BACKEND_FLAG} does not run with --disaggregation-mode prefill: SGLang sends a request's KV to "
            "decode before the plug-in can fail a host load that did not land; serve PD with hicache-cp's own "
            "PD adapter (hicache_cp.pd) or without --disaggregation-mode"
        )
    if mode == "decode":
        raise ValueError(
            f"{BACKEND_FLAG} does not run with --disaggregation-mode decode: a decode server's KV arrives "
            "through the PD transfer; hicache-cp is the prefill server's host tier"
        )
    if int(getattr(server_args, "attn_cp_size", 1) or 1) > 1:
        raise ValueError(
            f"{BACKEND_FLAG} does not run with --attn-cp-size {server_args.attn_cp_size}: the CP ranks' decisions "
            "would not be agreed"
        )
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        raise ValueError(
            f"{BACKEND_FLAG} does not run with --pp-size {server_args.pp_size}: a load decision would not be "
            "agreed across pipeline stages"
        )
