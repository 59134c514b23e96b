"""The replay on several prefill instances sharing an L3 tier (Mooncake Store).

`hicache-cp replay --l3 mooncake [--l3-master HOST:PORT] --instances N`:

    parent:      start a Mooncake master and a storage holder on 127.0.0.1
                 (unless --l3-master names one); spread the requests over the
                 instances (round-robin, or by session: all requests of a
                 chat session, or of a first trace block, on one instance)
    instance i:  a separate process with its own L1 and L2 (the same sizes as
                 a one-instance run) and its own store client, replaying its
                 share in trace order through the reference server; every
                 reused page, L3-fetched ones included, is checked byte for
                 byte after it was loaded into L1
    parent:      sum the instances' counters into one report, stop the master

Instances run concurrently, so which instance writes a shared prefix first,
and so the exact hit counts, depend on timing. Without `--l3` the instances
share nothing (the baseline). `cross_instance_hit_tokens` counts L3 hits on
pages this instance never put itself: another instance computed them.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from contextlib import nullcontext
from typing import Any

from hicache_cp.config import Config
from hicache_cp.l3.config import L3Config
from hicache_cp.l3.store import L3Error, reachable
from hicache_harness import lifetime
from hicache_harness.errors import InputError
from hicache_harness.l3_master import l3_service
from hicache_harness.replay.rank import replay_rank
from hicache_harness.replay.setup import check_processes, run_timeout_s, tokens_per_block
from hicache_harness.trace import TraceRequest, unique_blocks

logger = logging.getLogger(__name__)

SPREADS = ("round_robin", "session")
#: What the report gains (printed by `report.print_table`).
L3_REPORT_KEYS = (
    "instances", "l3_hit_tokens", "cross_instance_hit_tokens", "l3_put_bytes", "l3_get_bytes", "l3_failures",
    "l3_keys_per_request", "l3_prefetch_committed", "l3_prefetch_aborted", "l3_put_skipped_full",
)  # fmt: skip
# Counters each instance measures: summed.
_SUM_KEYS = (
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "bytes_d2h", "bytes_h2d",
    "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2", "integrity_checked_pages",
    "integrity_checked_units", "integrity_expected_units", "integrity_mismatches", "rejected_requests",
    "host_bytes", "cross_instance_hit_tokens", "backup_pages_wanted", "backup_pages_skipped",
    "backup_pages_dropped", "backup_pages_trimmed",
)  # fmt: skip
MIN_SEGMENT_BYTES = 64 << 20
#: How long a finished instance keeps its store segment (its objects) for the others.
FINISH_BARRIER_S = 600.0


class InstanceFailed(RuntimeError):
    """An instance process raised; the message is one line, its traceback is logged at INFO."""


def add_l3_arguments(p: argparse.ArgumentParser) -> None:
    """The replay's L3 and multi-instance options."""
    p.add_argument("--l3", choices=["mooncake"], help="add an L3 tier on Mooncake Store below L2")
    p.add_argument("--l3-master", metavar="HOST:PORT",
                   help="the Mooncake master to use (default: start one on 127.0.0.1 for the run)")
    p.add_argument("--l3-pages-per-object", type=int, default=None,
                   help="pages grouped into one L3 object (default: one 512-token trace block; fewer master keys)")
    p.add_argument("--l3-segment-mib", type=int, default=None,
                   help="memory each instance lends the store (default: twice the trace's footprint)")
    p.add_argument("--l3-write-queue", type=int, default=None, metavar="PAGES",
                   help="write-back queue bound in pages (default: the whole L2: the synthetic server computes "
                        "pages far faster than a real prefill, and a smaller queue skips most puts)")
    p.add_argument("--instances", type=int, default=1, help="prefill instances, one process each")
    p.add_argument("--spread", choices=SPREADS, default="round_robin",
                   help="how requests go to instances (session: a chat session, or a first block, stays on one)")
    # fmt: skip


def uses_instances(args: argparse.Namespace, config: Config | None = None) -> bool:
    """Whether this replay goes through `run_instances` (an L3 tier, from the
    flags or the config's [l3], or several instances)."""
    return (getattr(args, "l3", None) is not None or getattr(args, "instances", 1) > 1
            or (config is not None and config.l3.enabled))  # fmt: skip


def check_l3_args(args: argparse.Namespace) -> None:
    if args.instances < 1:
        raise InputError(f"--instances must be >= 1, got {args.instances}")
    check_processes("--instances", args.instances, "cli")
    if args.l3 is None and (args.l3_master or args.l3_pages_per_object or args.l3_segment_mib or args.l3_write_queue):
        raise InputError("--l3-master, --l3-pages-per-object, --l3-segment-mib and --l3-write-queue need --l3 mooncake")
    if (args.instances > 1 or args.l3 is not None) and ((args.cp_size or 1) > 1 or args.pd):
        raise InputError("--instances and --l3 replay cp_size 1 instances without --pd (the library's L3 supports CP)")
    for name in ("l3_pages_per_object", "l3_segment_mib", "l3_write_queue"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.l3_master is not None:
        host, _, port = args.l3_master.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"--l3-master: expected HOST:PORT, got {args.l3_master!r}")


def spread(requests: list[TraceRequest], n: int, how: str) -> list[list[TraceRequest]]:
    """Each instance's requests, in trace order."""
    shares: list[list[TraceRequest]] = [[] for _ in range(n)]
    owner: dict[object, int] = {}
    for i, req in enumerate(requests):
        if how == "round_robin":
            k = i % n
        else:  # a session's first appearance picks the next instance, round-robin
            key = req.session if req.session is not None else (req.hash_ids[0] if req.hash_ids else ("single", i))
            k = owner.setdefault(key, len(owner) % n)
        shares[k].append(req)
    return shares


def run_instances(
    args: argparse.Namespace, config: Config, requests: list[TraceRequest], sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the replay on `args.instances` instances; return the combined report.

    L3 is on with `--l3 mooncake` or the config's `[l3]` (backend mooncake).
    Each [l3] field the config set (TOML, env, --set: `sources`) is kept; the
    flags beat it, and what is left unset is derived here (the master: one
    started on 127.0.0.1; the segment; the write-back queue). The report's
    `l3_config` is the [l3] that ran."""
    check_l3_args(args)
    sources = sources or {}
    given = {name for name in L3Config.field_names() if sources.get(f"l3.{name}", "default") != "default"}
    use_l3 = args.l3 is not None or config.l3.enabled
    master = args.l3_master or (config.l3.master if "master" in given else None)
    if config.cp_size > 1:
        raise InputError(f"--instances and --l3 replay cp_size 1 instances; the config has cp_size {config.cp_size}")
    n = args.instances
    shares = spread(requests, n, args.spread)
    pages_per_block = max(1, tokens_per_block(args, config) // config.page_size)
    footprint = unique_blocks(requests) * pages_per_block * config.layout().bytes_per_page
    # Every instance lends the store room for the whole footprint (its puts land in its own segment).
    segment = (args.l3_segment_mib << 20) if args.l3_segment_mib else max(MIN_SEGMENT_BYTES, 2 * footprint)
    t0 = time.perf_counter()
    if use_l3 and master is not None:  # a master named by the user: reachable now, or a one-line error
        try:
            reachable(master, config.l3.connect_timeout_s, "replay")
        except L3Error as exc:
            raise InputError(f"--l3-master/l3.master: {exc}") from None
    if args.l3_segment_mib is None and "segment_bytes" in given:
        segment = config.l3.segment_bytes
    service = l3_service(master) if use_l3 else nullcontext(None)
    with service as address:
        if address is not None:
            queue_pages = args.l3_write_queue or (
                config.l3.write_queue_pages if "write_queue_pages" in given
                else config.host_budget_bytes // config.layout().bytes_per_page - 1)  # fmt: skip
            # One replayed page block stands for a 512-token trace block: objects of one block
            # (the library's default is 512 tokens of the real page size, MIN_OBJECT_TOKENS).
            group = args.l3_pages_per_object or (None if "pages_per_object" in given else pages_per_block)
            config = with_l3(config, address, group, segment, queue_pages)
        if n == 1:
            reports = [run_instance(0, args, config, shares[0])]
        else:
            reports = _spawn(args, config, shares)
    out = combine(reports, wall_s=time.perf_counter() - t0)
    out.update(instances=n, spread=args.spread, l3="mooncake" if use_l3 else "none",
               l3_master=master or ("started on 127.0.0.1" if use_l3 else None),
               l3_config=config.to_dict()["l3"])  # fmt: skip
    return out


def with_l3(config: Config, master: str, pages_per_object: int | None, segment_bytes: int, queue_pages: int) -> Config:
    """`config` with its L3 tier on Mooncake at `master` (other [l3] settings kept)."""
    l3 = dict(config.to_dict()["l3"])
    l3.update(backend="mooncake", master=master, segment_bytes=segment_bytes, write_queue_pages=queue_pages)
    if pages_per_object is not None:
        l3["pages_per_object"] = pages_per_object
    return Config.from_dict({**config.to_dict(), "l3": l3})


# ---- one instance ------------------------------------------------------------------------------


class CrossInstance:
    """Counts L3 hits on pages this instance did not put (an `L3Observer`), and
    stands in for the replay's request sink to carry the count to the report.

    A page counts when one of its objects was stored by another instance. An
    object can be in the store before this instance's put of it retires (the
    put worker stores a batch before it reports): a hit on a key this
    instance is still putting waits for that put's outcome (stored here: a
    self-hit; present already or failed: another instance's)."""

    def __init__(self, page_size: int, barrier: Any = None) -> None:
        self.page_size = page_size
        self.barrier = barrier
        self.mine: set[str] = set()  # keys this instance stored
        self.putting: dict[str, int] = {}  # keys of this instance's puts not retired yet (count of jobs)
        self.waiting: list[tuple[str, ...]] = []  # hit pages with a key still being put here
        self.cross_pages = 0
        self.totals = self

    def on_l3_put_started(self, keys: list[str]) -> None:
        for k in keys:
            self.putting[k] = self.putting.get(k, 0) + 1

    def on_l3_put(self, keys: list[str], stored: list[str]) -> None:
        self.mine.update(stored)
        for k in keys:
            left = self.putting.pop(k, 1) - 1  # (a put started before the observer was attached: 1)
            if left:
                self.putting[k] = left
        pages, self.waiting = self.waiting, []
        self.on_l3_hit(pages)

    def on_l3_hit(self, page_keys: list[tuple[str, ...]]) -> None:
        for keys in page_keys:
            if any(k not in self.mine and k not in self.putting for k in keys):
                self.cross_pages += 1
            elif any(k in self.putting and k not in self.mine for k in keys):
                self.waiting.append(keys)  # decided when this instance's put of it retires

    def send_request(self, request: int, node: object, hashes: object, cache: object, **_: object) -> None:
        pass  # not a PD sink: the engines call it after every request

    def as_dict(self) -> dict[str, int]:
        return {"cross_instance_hit_tokens": self.cross_pages * self.page_size}

    def close(self) -> None:
        """Called by the replay before it closes the cache: wait until every
        instance finished, so that no instance's segment (and the objects in
        it) goes away while another still reads."""
        if self.barrier is not None:
            try:
                self.barrier.wait(timeout=FINISH_BARRIER_S)
            except threading.BrokenBarrierError:
                logger.warning("an instance did not finish within %.0f s; closing anyway", FINISH_BARRIER_S)


def run_instance(
    index: int, args: argparse.Namespace, config: Config, requests: list[TraceRequest], barrier: Any = None
) -> dict[str, Any]:
    """One instance's replay (in this process); its report with the L3 counters on top."""
    tracker = CrossInstance(config.page_size, barrier)

    def sink_factory(cache: Any) -> CrossInstance:
        if cache.l3 is not None:
            cache.l3.observer = tracker
        return tracker

    if args.instances > 1:
        args = argparse.Namespace(**{**vars(args), "plot": None})  # one plot file, several writers
    if args.metrics_port is not None:  # instance i serves on P + i, as CP rank r does (the setup checked them free)
        args = argparse.Namespace(**{**vars(args), "metrics_port": args.metrics_port + index})
    report = replay_rank(args, config, requests, sink_factory=sink_factory, progress=index == 0)
    stats = report.get("stats", {})
    for k, v in stats.items():
        if k.startswith("l3_") or k == "cross_instance_hit_tokens":
            report[k] = v
    report.setdefault("cross_instance_hit_tokens", 0)
    report["instance"] = index
    return report


# ---- processes ---------------------------------------------------------------------------------


def _instance_main(index: int, args: argparse.Namespace, config: Config, requests: list[TraceRequest],
                   results: Any, barrier: Any, log_level: int) -> None:  # fmt: skip
    """Child process body: replay, report back. Never raises."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s instance{index} %(name)s: %(message)s")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        results.put(("ok", index, run_instance(index, args, config, requests, barrier)))
    except BaseException as exc:
        barrier.abort()  # the others stop waiting for this one
        results.put(("error", index, (f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())))


def _spawn(args: argparse.Namespace, config: Config, shares: list[list[TraceRequest]]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(len(shares))
    level = logging.getLogger().getEffectiveLevel()
    procs = [
        ctx.Process(target=lifetime.child_main,
                    args=(os.getpid(), _instance_main, i, args, config, share, results, barrier, level),
                    name=f"hicache-cp-instance{i}", daemon=True)  # fmt: skip
        for i, share in enumerate(shares)
    ]
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + run_timeout_s()
    try:
        lifetime.start_processes(procs)
        while len(reports) < len(procs):
            try:
                kind, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in reports and not p.is_alive()]
                if dead and results.empty():
                    time.sleep(1.0)  # a report may still be in the pipe
                    if results.empty():
                        raise RuntimeError(f"instance {dead[0]} exited with {procs[dead[0]].exitcode} without reporting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"instances {[i for i in range(len(procs)) if i not in reports]} did not finish")
                continue
            if kind == "error":
                summary, trace = payload
                logger.info("instance %d failed:\n%s", index, trace)  # the whole traceback with -v
                raise InstanceFailed(f"instance {index} failed: {summary} (run with -v for its traceback)")
            reports[index] = payload
    except BaseException:  # an instance failed, or the parent was interrupted: stop the rest now
        lifetime.stop_processes(procs)
        results.close()
        raise
    for p in procs:
        p.join(timeout=10)
    lifetime.stop_processes(procs)  # any still alive after reporting
    results.close()
    return [reports[i] for i in range(len(procs))]


# ---- the combined report -----------------------------------------------------------------------


def combine(reports: list[dict[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """One report: counters summed, hit rate recomputed, a `per_instance` table."""
    out = dict(reports[0])
    numeric = set(_SUM_KEYS) | {k for r in reports for k, v in r.items()
                                if k.startswith("l3_") and isinstance(v, int) and not isinstance(v, bool)}  # fmt: skip
    for k in numeric:
        out[k] = sum(int(r.get(k, 0) or 0) for r in reports)
    hits = out["l1_hit_tokens"] + out["l2_hit_tokens"] + out.get("l3_hit_tokens", 0)
    out["hit_rate"] = hits / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
    keys = sum(int(r.get("l3_lookup_keys", 0)) + int(r.get("l3_get_keys", 0)) + int(r.get("l3_put_keys", 0))
               for r in reports)  # fmt: skip
    if any("l3_lookup_keys" in r for r in reports):
        out["l3_keys_per_request"] = round(keys / max(1, out["requests"]), 3)
    out["mismatch_examples"] = [m for r in reports for m in r.get("mismatch_examples", [])][:10]
    out["wall_s"] = round(wall_s, 3)
    out.pop("stats", None)
    out.pop("samples", None)
    out["per_instance"] = [
        {k: r.get(k) for k in ("instance", "requests", "hit_rate", "l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens",
                               "cross_instance_hit_tokens", "l3_put_bytes", "l3_get_bytes", "l3_failures",
                               "integrity_mismatches", "wall_s")}  # fmt: skip
        for r in reports
    ]
    return out
