"""`hicache-cp bench-pd`: the PD adapter's throughput against raw TransferEngine writes.

Runs in one process on loopback: a `DecodePeer` (its own engine, served on a
thread) and a `PdSender` over an L1 `DevicePool` and an L2 `HostPool` (their
own engine). Each repeat opens a room and then, on the same coalesced runs
(same source and destination addresses, same lengths):

* raw: `batch_transfer_async_write` + `get_batch_transfer_status` straight on
  the sender's engine, in batches of at most the adapter's in-flight cap
  (the most a single peer accepts safely), each waited before the next;
* adapter: `PdSender.send` (planning included) through the adapter's wait,
  i.e. `RoomResult.transfer_s`; then the decode peer verifies every byte.

Reports the median of each over the repeats; ratio = adapter / raw
(target >= 0.90). `--json PATH` writes {adapter_gbps, raw_gbps, ratio,
bytes, descriptors, pages, commit, machine, command}.

    python -m hicache_harness.bench.pd --pages 512 --json pd.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness import checks, integrity
from hicache_harness.decode_peer import DecodePeer, add_layout_arguments, layout_from_args
from hicache_harness.errors import ExitCode, require
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.layout import KVLayout
from hicache_cp.pd.control import new_authkey
from hicache_cp.pd.engine import TransferError, quiet_mooncake_logs

logger = logging.getLogger(__name__)

#: Repeats run first and not counted (engine connections and page faults warm up).
WARMUP = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    parser.add_argument("--pages", type=int, default=512, help="pages per request")
    parser.add_argument("--l2-fraction", type=float, default=0.5, help="share of pages that live only in L2")
    parser.add_argument("--pattern", choices=("contiguous", "random"), default="random",
                        help="source page placement: one run per tier, or random sorted pages")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--overlap", action="store_true",
                        help="measure forward's end -> decode holds all KV, per-layer vs after-insert "
                             "(hicache_harness.bench.pd_overlap)")
    parser.add_argument("--layer-ms", type=float, default=2.0, help="--overlap: stand-in forward time per layer")
    parser.add_argument("--device", default="cpu", help="--overlap: L1 device (cpu or cuda[:N])")


MAX_PAGES = 1 << 20
MAX_REPEATS = 1000


def check_args(args: argparse.Namespace) -> KVLayout:
    """Every flag, before any work; returns the layout. Raises InputError."""
    checks.in_range("--pages", args.pages, 1, MAX_PAGES)
    checks.in_range("--repeats", args.repeats, 1, MAX_REPEATS)
    checks.in_range("--l2-fraction", args.l2_fraction, 0.0, 1.0)
    checks.output_file("--json", args.json)
    checks.in_range("--layer-ms", args.layer_ms, 0.0, 1000.0)
    args.device = checks.device("--device", args.device)
    quiet_mooncake_logs(getattr(args, "verbose", 0))  # before Mooncake loads
    require("mooncake.engine", "pd", "bench-pd")
    layout = layout_from_args(args)
    # L1 and L2 hold 2 * pages + 1 pages each, the decode peer pages + 1: all in host memory here.
    checks.fits_host_memory("bench-pd's pools", (5 * args.pages + 3) * layout.bytes_per_page)
    return layout


def run(args: argparse.Namespace) -> int:
    layout = check_args(args)
    if args.overlap:
        from hicache_harness.bench import pd_overlap

        return pd_overlap.run(args, layout)
    from hicache_cp.pd.sender import PageHomes, PdSender
    from hicache_cp.pools import DevicePool, HostPool

    n = args.pages
    pool_pages = 2 * n + 1
    rng = np.random.default_rng(args.seed)
    authkey = new_authkey()
    peer = DecodePeer(layout, n + 1, authkey=authkey)
    peer.start()
    l1 = DevicePool(layout, pool_pages)
    l2 = HostPool(layout, layout.bytes_per_page * pool_pages, pin=False)
    sender = PdSender(layout, l1, l2, decode_address=peer.address, authkey=authkey)
    try:
        pos = np.arange(n, dtype=np.int64)
        tier = (pos < int(round(args.l2_fraction * n))).astype(np.int8)  # a cached L2 prefix, the rest in L1
        pages = np.zeros(n, dtype=np.int64)
        for t in (0, 1):
            k = int((tier == t).sum())
            if args.pattern == "contiguous":
                phys = np.arange(1, k + 1)
            else:
                phys = np.sort(rng.choice(np.arange(1, pool_pages), k, replace=False))
            pages[tier == t] = cp_mapping.to_logical(phys, 0, 1)
        hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
        for t, pool in ((0, l1), (1, l2)):
            sel = tier == t
            for p in layout.parts:
                for slot, layer in enumerate(p.layer_ids):
                    pool.layer_view(p.part, slot)[pages[sel]] = integrity.content(hashes[sel], p.part, layer,
                                                                                  p.page_bytes)
        homes = PageHomes(pos, tier, pages, hashes)
        raw_gbps, adapter_gbps = [], []
        plan = None
        for rep in range(args.repeats + WARMUP):
            room_id = rep + 1
            sender.open_room(room_id, room_id, n)
            plan = sender.plan(room_id, homes)
            raw = plan.nbytes / _raw_write(sender, plan) / 1e9
            sender.send(room_id, homes)
            res = sender.finish(room_id)
            if not res.ok:  # the bytes did not arrive intact: an integrity failure, exit 1
                print(f"hicache-cp bench-pd: integrity failure: room {room_id}: {res.failure}", file=sys.stderr)
                return ExitCode.INTEGRITY
            sender.rooms.forget(room_id)
            if rep >= WARMUP:
                raw_gbps.append(raw)
                adapter_gbps.append(res.gbps)
        assert plan is not None
        raw, adapter = statistics.median(raw_gbps), statistics.median(adapter_gbps)
        out = {
            "adapter_gbps": round(adapter, 4), "raw_gbps": round(raw, 4), "ratio": round(adapter / raw, 4),
            "bytes": plan.nbytes, "descriptors": len(plan.lens), "pages": n,
            "mean_descriptor_bytes": plan.nbytes // max(1, len(plan.lens)),
            "repeats": args.repeats, "pattern": args.pattern, "layout": layout.describe(),
            "commit": git_commit(), "machine": machine(), "command": command_line("bench-pd"),
        }
        print(f"{'path':<10}{'GB/s (median)':>15}  runs (after {WARMUP} warm-up)")
        print(f"{'raw':<10}{raw:>15.3f}  {' '.join(f'{x:.3f}' for x in raw_gbps)}")
        print(f"{'adapter':<10}{adapter:>15.3f}  {' '.join(f'{x:.3f}' for x in adapter_gbps)}")
        print(f"ratio {adapter / raw:.3f}; {plan.nbytes / 2**20:.1f} MiB in {len(plan.lens)} descriptors "
              f"({n} pages, {args.pattern}); target ratio >= 0.90")
        if args.json is not None:
            write_json(args.json, out)
        return 0
    finally:
        sender.close()
        peer.close()
        l2.close()


def _raw_write(sender: object, plan: object) -> float:
    """Raw engine writes of the plan's runs; returns seconds."""
    eng = sender.adapter.engine  # type: ignore[attr-defined]
    peer = sender.peer  # type: ignore[attr-defined]
    step = sender.adapter.max_in_flight  # type: ignore[attr-defined]
    srcs, dsts, lens = plan.srcs, plan.dsts, plan.lens  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for lo in range(0, len(lens), step):
        bid = eng.batch_transfer_async_write(peer, srcs[lo:lo + step], dsts[lo:lo + step], lens[lo:lo + step])
        if bid == 0 or eng.get_batch_transfer_status([bid]) != 0:
            raise TransferError("raw batch write", peer=peer, transfers=len(lens[lo:lo + step]))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-cp bench-pd", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
