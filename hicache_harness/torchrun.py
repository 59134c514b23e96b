"""`torchrun ... -m hicache_harness.torchrun`: the replay with one process per CP rank under torchrun.

    torchrun --nproc-per-node 2 -m hicache_harness.torchrun --trace t.jsonl --l2-fraction 0.1
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hicache_cp.cp import groups
from hicache_harness import lifetime
from hicache_harness.replay import command, setup
from hicache_harness.replay.multirank import combine_reports
from hicache_harness.replay.rank import replay_rank
from hicache_harness.outputs import write_json
from hicache_harness.replay.report import print_table


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: every rank replays; rank 0 prints the combined report.

    Takes the `hicache-cp replay` options; --cp-size is the torchrun world size.
    """
    parser = argparse.ArgumentParser(prog="python -m hicache_harness.torchrun", description=main.__doc__)
    command.add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.pd:
        raise SystemExit("python -m hicache_harness.torchrun: --pd is not supported under torchrun; use hicache-cp replay --pd")
    # torchrun's agent is the parent: die with it, and unwind on its SIGTERM (130/143).
    lifetime.die_with_parent(os.getppid())
    try:
        with lifetime.stop_on_signals():
            return _run(args)
    except lifetime.Interrupted as exc:
        print(f"python -m hicache_harness.torchrun: {exc}", file=sys.stderr)
        return exc.exit_code


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    group = groups.init_process_group()
    args.cp_size = group.world_size
    try:
        setup.check_args(args)
        requests = setup.load_requests(args)
        config = setup.build_config(args, requests)[0].config
        agreement = groups.cp_agreement(group)
        report = replay_rank(args, config, requests, rank=group.rank, agreement=agreement,
                                    progress=group.rank == 0)
        report["collectives"] = agreement.collectives
        reports: list[dict[str, object] | None] = [None] * group.world_size
        dist.all_gather_object(reports, report)
    finally:
        groups.destroy_process_group()
    if group.rank != 0:
        return 0
    combined = combine_reports(reports, wall_s=max(float(r["wall_s"]) for r in reports))  # type: ignore[index, arg-type]
    print_table(combined)
    if args.json:
        write_json(args.json, combined)
    return 1 if combined["integrity_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
