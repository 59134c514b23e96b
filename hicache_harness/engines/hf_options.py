"""Command-line options of the hf engine (`hicache-cp replay --engine hf ...`).

Kept apart from `hf` so that building the replay's parser imports neither
torch's model code nor transformers.
"""

from __future__ import annotations

import argparse
import math

from hicache_harness.errors import InputError

HF_PRESETS = ("tiny", "dsv32-width")
#: `--spec-steps` default, and its bound: each step is one forward per checked request
#: from the restored prefix and one from the recompute (MTP drafts propose 1-7 tokens).
SPEC_STEPS = 4
MAX_SPEC_STEPS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hf engine (--engine hf)")
    g.add_argument("--hf-preset", choices=HF_PRESETS, default="tiny",
                   help="model preset: tiny (CPU, CI) or dsv32-width (real DeepSeek-V3.2 widths, bf16, GPU)")
    g.add_argument("--hf-seed", type=int, default=0, help="seed of the random weights")
    g.add_argument("--chunk-tokens", type=int, help="chunked prefill: tokens of one sequence per forward (default: the preset's)")
    g.add_argument("--max-batch-tokens", type=int, help="tokens one forward computes, all its sequences together (default: the preset's)")
    g.add_argument("--schedule", choices=["short-first", "fcfs"], default="short-first",
                   help="short-first: a forward with sequences that finish within half a chunk runs only those "
                        "(hit requests' tails), fewest tokens first; fcfs: running sequences, then new ones")
    g.add_argument("--arrivals", choices=["asap", "trace"], default="asap",
                   help="requests arrive all at once (asap) or at their trace timestamps (trace)")
    g.add_argument("--time-scale", type=float, default=1.0, help="with --arrivals trace: multiply the timestamps by this")
    g.add_argument("--check-outputs", type=int, default=0, metavar="N",
                   help="compare the last-token logits of N hit requests, and their MTP draft's logits and "
                        "proposed token, with a full recompute")
    g.add_argument("--spec-steps", type=int, default=SPEC_STEPS, metavar="K",
                   help="with --check-outputs: K steps of greedy MTP speculation from each checked request's "
                        "restored prefix and from a recompute; their accept lengths are compared (0: off)")
    g.add_argument("--hf-fault", action="append", metavar="KIND:PART:LAYER@RANK",
                   help="inject a fault on the first load from L2 with a page RANK owns (testing): "
                        "corrupt, drop-draft or fail-copy, e.g. corrupt:draft_kv:0@1 (see hf_faults)")
    g.add_argument("--recompute-samples", type=int, default=8, metavar="N",
                   help="time a recompute (no cache) of up to N requests with >= 90%% hits, for ttft_hit_over_recompute")
    g.add_argument("--compare-no-l2", action="store_true", help="also run the same trace with L2 off and report both")
    g.add_argument("--ttft-probe", type=int, default=0, metavar="N",
                   help="after the replay, N pairs of the same prompt hitting in L1 and in L2 (ttft_l2_over_l1_hit), "
                        "and the forward's time per layer with and without copies in flight (see hf_probe)")
    # fmt: skip


def refuse_without_hf(args: argparse.Namespace) -> None:
    """An hf option set away from its default without `--engine hf` would be
    ignored without a word: refuse it, naming the flag. (A flag given at its
    default changes nothing, so it cannot be told apart and needs no refusal.)"""
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)  # the defaults, from the one table above
    for dest, default in vars(probe.parse_args([])).items():
        if getattr(args, dest, default) != default:
            flag = "--" + dest.replace("_", "-")
            raise InputError(f"{flag} (from cli) is an option of the hf engine; it needs --engine hf")


def check_cp_size(args: argparse.Namespace, cp_size: int | None) -> None:
    """What the hf engine cannot do under CP (one process per rank, `hf_cp`)."""
    if cp_size is None or cp_size == 1:
        return
    if getattr(args, "compare_no_l2", False):
        raise InputError(f"--compare-no-l2 runs on one rank; drop it or --cp-size {cp_size}")
    if getattr(args, "ttft_probe", 0):
        raise InputError(f"--ttft-probe runs on one rank; drop it or --cp-size {cp_size}")
    if getattr(args, "pd", False):
        raise InputError(f"--pd with --engine hf runs on one rank for now (CP + PD is its own issue); got --cp-size {cp_size}")


def check(args: argparse.Namespace, page_size: int) -> None:
    """Fail fast, as one line, on options the hf engine cannot run with."""
    if getattr(args, "model", None):
        raise InputError("--model picks the synthetic engine's layout; --engine hf derives its layout from --hf-preset")
    check_cp_size(args, getattr(args, "cp_size", None))
    for name in ("chunk_tokens", "max_batch_tokens"):
        value = getattr(args, name)
        if value is not None and value < page_size:
            raise InputError(f"--{name.replace('_', '-')} must be at least one page ({page_size} tokens), got {value}")
    for name in ("check_outputs", "recompute_samples", "spec_steps", "ttft_probe"):
        if getattr(args, name) < 0:
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.spec_steps > MAX_SPEC_STEPS:
        raise InputError(f"--spec-steps must be at most {MAX_SPEC_STEPS}, got {args.spec_steps}")
    if args.spec_steps != SPEC_STEPS and not args.check_outputs:  # it would be ignored without a word
        raise InputError(f"--spec-steps {args.spec_steps} speculates from the requests --check-outputs N checks; "
                         "it needs --check-outputs")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):  # nan/inf: no arrival ever comes
        raise InputError(f"--time-scale must be a finite number > 0, got {args.time_scale}")
    from hicache_harness.engines.hf_faults import HfFault  # checked before any work

    for text in getattr(args, "hf_fault", None) or ():
        HfFault.parse(text)
