"""The restore checks' own CPU time on the replay's thread, on CPU (the `cpu` backend).

bench-verify's ratio of whole replays (checks on over off) moves by more than
the checks cost when the machine is shared. This tool times only the checks'
work on the thread that runs the replay, with `time.thread_time` (CPU time of
that thread: other processes and threads do not count), in replays with
`verify_restores=all`:

* `HostChecks.run`: hashing what the copy workers did not, salting, storing
  or comparing (`hicache_cp.io.verify`);
* `HostChecks.__init__`: an op's checks set up;
* `Lifecycle.identity`: the identity tags (prefix hashes) salted into them.

The copy workers' hashing of large copies is not on that thread and not
counted. To compare two commits, run it from each checkout (the library comes
from the working directory, its commit into the JSON):

    PYTHONPATH=$PWD python bench/scripts/verify_thread_time.py [--trace T] [--rounds 3] [--numpy-hashes] [--json P]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hicache_cp import checksum
from hicache_cp.cache import lifecycle
from hicache_cp.io import verify
from hicache_harness.outputs import write_json
from hicache_harness.provenance import git_commit, machine
from hicache_harness.replay import command

_REPO = Path(__file__).resolve().parents[2]
TIMED = {"run": (verify.HostChecks, "run"), "init": (verify.HostChecks, "__init__"),
         "identity": (lifecycle.Lifecycle, "identity")}  # fmt: skip


def _timed(totals: dict[str, float], key: str, f: Any) -> Any:
    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            totals[key] += time.thread_time() - t0

    return timed


def _rounds(replay_argv: list[str], n: int) -> list[dict[str, float]]:
    """The timed functions' thread CPU time in each of `n` replays, after an untimed one."""
    totals = dict.fromkeys(TIMED, 0.0)
    for key, (cls, name) in TIMED.items():
        setattr(cls, name, _timed(totals, key, getattr(cls, name)))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    command.replay(parser.parse_args(replay_argv))  # untimed: imports, first-use tables
    rounds = []
    for _ in range(n):
        for key in totals:
            totals[key] = 0.0
        command.replay(parser.parse_args(replay_argv))
        rounds.append({**totals, "total": sum(totals.values())})
    return rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=_REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl",
                    help="Mooncake-format trace (default: the shared one beside the repository)")
    ap.add_argument("--l2-fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3, help="timed replays after one untimed (default 3)")
    ap.add_argument("--numpy-hashes", action="store_true", help="hash with numpy where the compiled hashes are built")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.trace.exists():
        print(f"verify_thread_time: no trace at {args.trace}", file=sys.stderr)
        return 2
    replay_argv = ["--model", "tiny", "--set", "verify_restores=all", "--device", "cpu", "--trace", str(args.trace),
                   "--l2-fraction", str(args.l2_fraction)]  # fmt: skip
    with checksum.numpy_hashes() if args.numpy_hashes else contextlib.nullcontext():
        rounds = _rounds(replay_argv, args.rounds)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    hashes = "numpy" if args.numpy_hashes or not checksum.NATIVE else "compiled"
    print(f"restore checks' thread CPU time a replay at {git_commit()}, {hashes} hashes (median of {args.rounds}): "
          + ", ".join(f"{k} {v:.3f} s" for k, v in median.items()))  # fmt: skip
    if args.json:
        write_json(args.json, {"commit": git_commit(), "machine": machine(),
                               "command": "python bench/scripts/verify_thread_time.py " + " ".join(sys.argv[1:]),
                               "replay": replay_argv, "hashes": hashes, "rounds_s": rounds, "median_s": median})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
