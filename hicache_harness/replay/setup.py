"""What a replay runs on: its requests, its sizing and its configuration.

Configuration: defaults and the model preset < `--config` TOML <
`HICACHE_*` environment < command line (`--set FIELD=VALUE`, and the named
flags such as `--model`, `--policy`, `--cp-size`), for every field. The
report records each effective value with its source.

Sizing (logical pages; with `--cp-size N` they are split over N ranks):

    L2   --l2-gib G (per rank) or --l2-fraction F (of the trace's unique-block
         footprint), else `host_budget_bytes` when the TOML, the environment
         or --set gave it (per rank; "auto" sizes from this machine), else
         F = 0.1 for a trace and 0.5 for the embedded workload
    L1   --l1-pages (logical), else `l1_pages` when given (per rank, the
         dummy page included), else L2 / 8 but at least three of the longest
         requests

One trace block (512 tokens) becomes `--tokens-per-block` tokens (default:
one page of the model's page size; a multiple of the page size), so a whole
trace replays on a CPU in minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from hicache_cp.config import Config, ResolvedConfig
from hicache_cp.errors import ConfigError
from hicache_cp.cp.agreement import LocalAgreement
from hicache_cp.cache.build import host_budget
from hicache_harness import checks
from hicache_harness.engines import config_overrides, model_bytes
from hicache_harness.errors import InputError, require
from hicache_harness.trace import TraceRequest, load_trace, unique_blocks
from hicache_harness.workload import default_workload
from hicache_cp.io.base import CUDA_BACKENDS

EMBEDDED_L2_FRACTION = 0.5  # the embedded workload is small: give L2 room to matter
TRACE_L2_FRACTION = 0.1
L2_TO_L1 = 8  # default L1 = L2 / 8
MAX_CP_SIZE = 64
MAX_PAGES = 1 << 40
DEFAULT_METRICS_ADDR = "127.0.0.1"
PROCESS_BYTES = 512 << 20  # one rank or instance process: Python, torch, its pools' bookkeeping
PROCESSES_PER_CORE = 4  # no flag may ask for more pages than this, whatever the machine


@dataclass(frozen=True)
class Sizing:
    """Logical capacities of the run and what they became per rank."""

    footprint_pages: int
    l1_logical_pages: int
    l2_logical_pages: int
    l1_physical_pages: int  # per rank, dummy page included
    host_budget_bytes: int  # per rank
    l1_source: str
    l2_source: str


def check_args(args: argparse.Namespace) -> None:
    """Every flag that can be checked without reading the trace; raises InputError."""
    checks.positive("--l1-pages", args.l1_pages, limit=MAX_PAGES)
    checks.positive("--tokens-per-block", args.tokens_per_block, limit=1 << 20)
    checks.positive("--limit", args.limit)
    checks.positive("--l2-gib", args.l2_gib, limit=1 << 20)
    if args.l2_fraction is not None:
        checks.positive("--l2-fraction", args.l2_fraction, limit=1.0)
    checks.in_range("--cp-size", args.cp_size, 1, MAX_CP_SIZE)
    checks.in_range("--seed", args.seed, 0, 2**32 - 1)
    checks.input_file("--trace", args.trace)
    checks.input_file("--config", args.config)
    checks.output_file("--json", args.json)
    checks.output_file("--plot", args.plot)
    args.device = checks.device("--device", args.device)
    if args.plot is not None:
        require("matplotlib", "plot", "--plot")
    if args.pd or getattr(args, "l3", None):
        from hicache_cp.pd.engine import quiet_mooncake_logs

        quiet_mooncake_logs(getattr(args, "verbose", 0))  # before Mooncake loads; the ranks inherit it
    if args.pd:
        require("mooncake.engine", "pd", "--pd")
    elif getattr(args, "pd_timeout_s", None) is not None or getattr(args, "pd_per_layer", None):
        raise InputError("--pd-timeout-s and --pd-per-layer need --pd")
    checks.ip_literal("--metrics-addr", args.metrics_addr)
    if args.metrics_port is not None:
        checks.in_range("--metrics-port", args.metrics_port, 1, 65535 - MAX_CP_SIZE)
        require("prometheus_client", "metrics", "--metrics-port")
        ranks = max(args.cp_size or 1, getattr(args, "instances", 1) or 1)
        checks.ports_free("--metrics-port", args.metrics_addr, range(args.metrics_port, args.metrics_port + ranks))
    elif args.metrics_addr != DEFAULT_METRICS_ADDR:
        raise InputError(f"--metrics-addr {args.metrics_addr} needs --metrics-port")
    _check_kv_events(args)
    for item in args.set or ():
        if "=" not in item or not item.partition("=")[0].strip():
            raise InputError(f"--set {item!r}: expected FIELD=VALUE")
    run_timeout_s()


def _check_kv_events(args: argparse.Namespace) -> None:
    endpoint = getattr(args, "kv_events", None)
    if endpoint is None:
        if getattr(args, "kv_events_format", None) is not None:
            raise InputError("--kv-events-format needs --kv-events")
        return
    from hicache_harness.kv_events import check_endpoint

    host, port = check_endpoint("--kv-events", endpoint)
    require("zmq", "events", "--kv-events")
    require("msgspec", "events", "--kv-events")
    fmt = getattr(args, "kv_events_format", None) or "sglang"
    if importlib.util.find_spec(fmt) is None:  # its keys and event classes are the engine's own
        raise InputError(f"--kv-events-format {fmt} needs {fmt} installed (scripts/install_{fmt}.sh)")
    if (getattr(args, "instances", 1) or 1) > 1:
        raise InputError("--kv-events publishes one cache's events: it does not take --instances")
    checks.ports_free("--kv-events", host, range(port, port + 1))


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is None:
        requests = default_workload(seed=args.seed)
        return requests[: args.limit] if args.limit else requests
    return load_trace(args.trace, limit=args.limit)


def tokens_per_block(args: argparse.Namespace, config: Config) -> int:
    return args.tokens_per_block or config.page_size


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the command line sets: `--set` first, then the named flags."""
    out: dict[str, Any] = {}
    for item in args.set or ():
        name, _, value = item.partition("=")
        out[name.strip()] = value.strip()
    named = {
        "model": args.model,
        "eviction_policy": args.policy,
        "write_policy": args.write_policy,
        "io_backend": args.io_backend,
        "cp_size": args.cp_size,
        "pd_timeout_s": getattr(args, "pd_timeout_s", None),
        "pd_per_layer": getattr(args, "pd_per_layer", None),
        "node_segment": getattr(args, "node_segment", None),
    }
    # Flags that size a field another way: with --set for that field as well, which wins is unclear. Refused.
    sized = {"l1_pages": ("--l1-pages", args.l1_pages), "host_budget_bytes": ("--l2-gib/--l2-fraction",
             args.l2_gib if args.l2_gib is not None else args.l2_fraction)}  # fmt: skip
    for name, (flag, value) in sized.items():
        if value is not None and name in out:
            raise InputError(f"--set {name}={out[name]} and {flag} {value} both size {name}: give one")
    for name, value in named.items():
        if value is None:
            continue
        if name in out and str(out[name]) != str(value):
            raise InputError(f"--set {name}={out[name]} contradicts the flag that sets {name} to {value}")
        out[name] = value
    return out


def max_processes() -> int:
    """Most rank or instance processes this machine runs at once: each is a
    Python with torch (about PROCESS_BYTES) and wants a core of its own at
    least every PROCESSES_PER_CORE; never above MAX_CP_SIZE."""
    import os

    from hostmem.sizing import host_memory

    by_memory = host_memory(reserve_bytes=0).available_bytes // PROCESS_BYTES
    return int(max(1, min(MAX_CP_SIZE, PROCESSES_PER_CORE * (os.cpu_count() or 1), by_memory)))


def check_processes(what: str, n: int, source: str) -> None:
    limit = max_processes()
    if n > limit:
        raise InputError(f"{what} {n} (from {source}) exceeds what this machine runs at once: at most {limit} "
                         f"({PROCESSES_PER_CORE} per core, {PROCESS_BYTES >> 20} MiB each, at most {MAX_CP_SIZE})")  # fmt: skip


def run_timeout_s() -> float:
    """`HICACHE_CP_RANK_TIMEOUT_S`: the deadline of a multi-process run (default one hour), checked."""
    import os

    from hicache_harness.launch import DEFAULT_RUN_TIMEOUT_S

    raw = os.environ.get("HICACHE_CP_RANK_TIMEOUT_S")
    if raw is None:
        return DEFAULT_RUN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise InputError(f"HICACHE_CP_RANK_TIMEOUT_S={raw!r}: expected a finite number of seconds > 0")
    return value


def build_config(args: argparse.Namespace, requests: list[TraceRequest],
                 defaults: dict[str, Any] | None = None) -> tuple[ResolvedConfig, Sizing]:
    """The effective configuration of the run (with sources) and its sizing.

    `defaults`: a command's own defaults (source "default:<command>"), below
    the TOML, the environment and the command line. The fields the engine
    fixes (`config_overrides`: the hf model's layout and page size) are
    recorded with the engine as their source; another value for one of them
    from any source is refused."""
    engine = getattr(args, "engine", None) or "synthetic"
    engine_source = f"engine:{engine}" + (f":{args.hf_preset}" if engine == "hf" else "")
    base = Config.resolve(args.config, overrides=cli_overrides(args), defaults=defaults,
                          defaults_source=f"default:{getattr(args, 'command', None) or 'command'}",
                          fixed=config_overrides(args), fixed_source=engine_source)  # fmt: skip
    check_processes("cp_size", base.config.cp_size, base.sources["cp_size"])
    check_processes("--node-ranks", getattr(args, "node_ranks", None) or 1, "cli:--node-ranks")
    _check_machine(base, args)
    _check_unused(base, args)
    tpb = tokens_per_block(args, base.config)
    if tpb % base.config.page_size:
        raise InputError(f"--tokens-per-block {tpb} is not a multiple of the page size ({base.config.page_size})")
    sizing = size(args, base, requests)
    values = {**base.config.to_dict(), "l1_pages": sizing.l1_physical_pages, "host_budget_bytes": sizing.host_budget_bytes}
    sources = {**base.sources, "l1_pages": sizing.l1_source, "host_budget_bytes": sizing.l2_source}
    resolved = ResolvedConfig(Config.from_dict(values), sources)
    cp = resolved.config.cp_size
    resolved.check(lambda c: c.check_free_room("l1", (c.l1_pages - 1) * cp))  # what the pools will hold, logical
    resolved.check(lambda c: c.check_free_room("l2", sizing.l2_logical_pages))
    _check_memory(resolved.config, args.device, model_bytes(args), getattr(args, "node_ranks", None) or 1)
    return resolved, sizing


def size(args: argparse.Namespace, resolved: ResolvedConfig, requests: list[TraceRequest]) -> Sizing:
    """Turn the capacities asked for into per-rank pool sizes (see the module docstring)."""
    config, sources = resolved.config, resolved.sources
    layout = config.layout()
    tpb = tokens_per_block(args, config)
    pages_per_block = tpb // config.page_size
    footprint = max(1, unique_blocks(requests) * pages_per_block)
    longest = max((len(r.hash_ids) for r in requests), default=1) * pages_per_block
    cp = config.cp_size
    if args.l2_gib is not None:
        budget, l2_source = int(args.l2_gib * 2**30), "cli:--l2-gib"
    elif args.l2_fraction is None and sources["host_budget_bytes"] != "default":
        budget, l2_source = host_budget(config, LocalAgreement()), sources["host_budget_bytes"]
    else:
        fraction = args.l2_fraction or (TRACE_L2_FRACTION if args.trace else EMBEDDED_L2_FRACTION)
        l2_pages = max(1, math.ceil(fraction * footprint))
        budget = (math.ceil(l2_pages / cp) + 1) * layout.bytes_per_page
        l2_source = "cli:--l2-fraction" if args.l2_fraction else f"derived:{fraction} of the footprint"
    l2 = (budget // layout.bytes_per_page - 1) * cp
    if l2 < cp:
        raise InputError(f"L2 of {budget} B per rank holds no page ({layout.bytes_per_page} B a logical page)")
    if args.l1_pages is not None:
        l1, l1_source = args.l1_pages, "cli:--l1-pages"
    elif sources["l1_pages"] != "default":
        l1, l1_source = (config.l1_pages - 1) * cp, sources["l1_pages"]
    else:
        # L2 is typically 5-20x L1 (docs/invariants.md, the setting); L1 must still hold a few requests.
        l1, l1_source = max(l2 // L2_TO_L1, 3 * longest), "derived:L2/8, at least 3 longest requests"
    if l1 < longest + cp:
        raise InputError(f"L1 of {l1} logical pages ({l1_source}) cannot hold the longest request ({longest} pages)")
    return Sizing(footprint, l1, l2, math.ceil(l1 / cp) + 1, budget, l1_source, l2_source)




def _check_machine(resolved: ResolvedConfig, args: argparse.Namespace) -> None:
    """Settings this machine or this run cannot honour: refused before any work."""
    config, sources = resolved.config, resolved.sources
    cuda = str(args.device).startswith("cuda")
    if config.io_backend in CUDA_BACKENDS and not cuda:
        raise InputError(f"io_backend = {config.io_backend} (from {sources['io_backend']}) copies with CUDA, "
                         f"but the L1 device is {args.device}; use io_backend cpu or auto")  # fmt: skip
    if config.pin_host is True and not cuda:
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"pin_host = true (from {sources['pin_host']}) needs CUDA to pin host memory; "
                             "this machine has none (use false or auto)")  # fmt: skip
    if args.plot is not None and (config.cp_size > 1 or getattr(args, "instances", 1) > 1):
        raise InputError(f"--plot draws one process's run; cp_size {config.cp_size}, "
                         f"--instances {getattr(args, 'instances', 1)} have several (drop --plot or run one)")  # fmt: skip


#: The --l3-* flags and the [l3] field each one sets (a flag beats the config's value).
L3_FLAGS = {"l3_master": ("--l3-master", "master"), "l3_pages_per_object": ("--l3-pages-per-object", "pages_per_object"),
            "l3_segment_mib": ("--l3-segment-mib", "segment_bytes"), "l3_write_queue": ("--l3-write-queue",
            "write_queue_pages")}  # fmt: skip


def _check_unused(resolved: ResolvedConfig, args: argparse.Namespace) -> None:
    """Settings the run would ignore or contradict, from any source: refused, naming it.

    PD fields without --pd, [l3] fields with L3 off (unless the config itself turned
    L3 off: a section kept with ``enabled = false``), an --l3-* flag against the
    same field given by --set, and ``l3.protocol = "rdma"`` without an RDMA device."""
    config, sources = resolved.config, resolved.sources
    given = {k: v for k, v in sources.items() if v != "default" and not v.startswith("default:")}
    if not args.pd:
        for name in ("pd_timeout_s", "pd_per_layer"):
            if name in given:
                raise InputError(f"{name} (from {given[name]}) configures PD, which this run does not use; "
                                 f"drop it or add --pd")
    use_l3 = getattr(args, "l3", None) is not None or config.l3.enabled
    turned_off = "l3.backend" in given and not config.l3.enabled
    if not use_l3 and not turned_off:
        for key in sorted(k for k in given if k.startswith("l3.") and k != "l3.backend"):
            raise InputError(f"{key} (from {given[key]}) configures L3, which is off; drop it, or add --l3 mooncake "
                             f"(or l3.backend = \"mooncake\")")
    for dest, (flag, field) in L3_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and sources.get(f"l3.{field}") == "cli":
            mine = value << 20 if dest == "l3_segment_mib" else value
            if mine != getattr(config.l3, field):
                raise InputError(f"--set l3.{field}={getattr(config.l3, field)} contradicts {flag} {value}; give one")
    if use_l3:
        from hicache_cp.l3.store import check_protocol

        try:
            check_protocol(config.l3)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {sources.get('l3.protocol', 'default')})") from None


def _check_memory(config: Config, device: str, model: int = 0, node_ranks: int = 1) -> None:
    """Refuse pools, and an engine's model (`model` bytes per rank, built on the rank's
    device), that this machine cannot hold, with the numbers, before allocating any.
    `node_ranks`: the ranks of one node the run starts (they share a node segment)."""
    layout = config.layout()
    ranks = max(config.cp_size, node_ranks)  # every rank runs on this machine
    l1_bytes = config.l1_pages * layout.bytes_per_page
    l2_bytes = int(config.host_budget_bytes)
    if config.node_segment and config.cp_size == 1 and config.node_sharing != "per_rank":
        l2_bytes //= ranks  # one copy for the node's ranks
    with_model = " + the model" if model else ""
    if device == "cpu":
        checks.fits_host_memory(f"L1 + L2{with_model} of {ranks} rank(s)", ranks * (l1_bytes + l2_bytes + model))
    else:
        checks.fits_host_memory(f"L2 of {ranks} rank(s)", ranks * l2_bytes)
        checks.fits_device_memory(f"L1{with_model} of one rank", l1_bytes + model, device)
