"""`hicache-cp`: the command-line entry point.

    hicache-cp replay        the main job: replay a trace through the cache, verify every byte
    hicache-cp bench-alloc   host page allocator microbenchmark (metadata only, CPU)
    hicache-cp bench-io      per-layer D2H/H2D copy engine vs the PCIe peak (GPU)
    hicache-cp bench-pd      PD adapter vs raw Mooncake TransferEngine (loopback)
    hicache-cp bench-overhead host time of the cache's own calls per request on a trace
    hicache-cp bench-l3      L3 tier put/get vs raw Mooncake Store calls (loopback)
    hicache-cp bench-pinning time to a usable pinned host pool vs cudaHostAlloc (GPU; CPU parts anywhere)
    hicache-cp bench-events  cost of publishing KV cache events per replay, and what they buy a router (CPU)
    hicache-cp bench-sglang  hicache-cp against SGLang's own HiCache inside SGLang's scheduler (GPU; CPU parts anywhere)
    hicache-cp bench-verify  the restore checks' cost: replay on vs off (CPU), kernel vs PCIe and beside a forward (GPU)
    hicache-cp bench-node    the node tier: adoption time, checksum rate, host and D2H bytes per rank
    hicache-cp decode-peer   a decode-side peer that receives and verifies KV
    hicache-cp node-segment  list, show or drop the node tier's shared segments (docs/node-tier.md)

Each subcommand lives in its own module exposing `add_arguments(parser)`
and `run(args) -> int`; modules are imported only when their command runs,
so optional dependencies (CUDA, Mooncake) are needed only by their command.
`kill -USR1 <pid>` prints every thread's stack to stderr (so does a crash).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import logging
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any, NoReturn

from hicache_harness import lifetime
from hicache_harness.errors import ExitCode, IntegrityFailure, bad_input_types

COMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("hicache_harness.replay.command", "replay a trace through the reference server (the main job)"),
    "bench-alloc": ("hicache_harness.bench.alloc", "allocator microbenchmark on a fragmented pool"),
    "bench-io": ("hicache_harness.bench.io", "copy-engine bandwidth and overlap on the GPU"),
    "bench-pd": ("hicache_harness.bench.pd", "PD adapter throughput vs raw TransferEngine"),
    "bench-overhead": ("hicache_harness.bench.overhead", "host time of the cache's own calls per request on a trace"),
    "bench-l3": ("hicache_harness.bench.l3", "L3 tier put/get vs raw Mooncake Store calls (loopback)"),
    "bench-pinning": ("hicache_harness.bench.pinning", "time to a usable pinned host pool vs cudaHostAlloc, and its copy bandwidth"),
    "bench-events": ("hicache_harness.bench.events", "cost of publishing KV cache events, and what they buy a router"),
    "bench-sglang": ("hicache_harness.bench.sglang_race", "hicache-cp against SGLang's own HiCache, one process, one GPU"),
    "bench-verify": ("hicache_harness.bench.verify", "what the restore checks cost: replay with them on vs off, the kernel vs PCIe"),
    "bench-node": ("hicache_harness.bench.node", "the node tier: adoption time, checksum rate, host and D2H bytes per rank"),
    "decode-peer": ("hicache_harness.decode_peer", "run a decode peer that receives and verifies KV"),
    "node-segment": ("hicache_harness.node_segment", "list, show or drop the node tier's shared segments"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit code 2), without the
    usage block, and takes flags only spelt out (an abbreviation silently
    meaning another flag is a trap)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hicache-cp",
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 ok, 1 integrity failure, 2 invalid input, 3 internal error",
    )
    verbose = _Parser(add_help=False)  # -v before or after the subcommand
    verbose.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                         help="-v: INFO logging and tracebacks, -vv: DEBUG")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: INFO logging and tracebacks, -vv: DEBUG")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, parents=[verbose])
        if name == chosen:  # import only the module of the command being run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; the one place that turns exceptions (and SIGINT/SIGTERM:
    130/143, children stopped, see `lifetime`) into exit codes."""
    if argv is None:  # this process's own command line (tests pass argv and keep their own handlers)
        _dump_stacks_on_crash_and_sigusr1()
    argv = sys.argv[1:] if argv is None else argv
    try:
        with lifetime.stop_on_signals():
            code = _main(argv)
            lifetime.raise_if_interrupted()  # a signal whose exception was swallowed: still 128 + signal
            return code
    except (lifetime.Interrupted, KeyboardInterrupt) as exc:
        code = exc.exit_code if isinstance(exc, lifetime.Interrupted) else 130
        with contextlib.suppress(OSError):
            print(f"hicache-cp: {exc or 'interrupted'}", file=sys.stderr)
        return code


def _dump_stacks_on_crash_and_sigusr1() -> None:
    """A crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to
    stderr, and so does `kill -USR1 <pid>` on a run that looks stuck.

    SIGUSR1 gets a Python handler, run on the main thread between bytecodes with
    the GIL held: faulthandler's own dump reads the other threads' frames from
    inside the signal while they run, and can crash the process it inspects
    (CPython gh-116008; it killed a replay here with SIGSEGV)."""
    faulthandler.enable(all_threads=True)
    signal.signal(signal.SIGUSR1, _print_every_stack)


def _print_every_stack(signum: int, frame: FrameType | None) -> None:
    """Every thread's Python stack to stderr, most recent call last; the run goes on."""
    names = {t.ident: t.name for t in threading.enumerate()}
    current = threading.get_ident()
    out = [f"hicache-cp: signal {signum}: the Python stack of every thread\n"]
    for ident, top in sys._current_frames().items():  # noqa: SLF001 - the documented way to see other threads
        out.append(f"Thread {ident:#x} ({names.get(ident, 'not started by threading')})"
                   f"{' (the main thread, here)' if ident == current else ''}:\n")  # fmt: skip
        out.extend(traceback.format_stack(top))
    with contextlib.suppress(OSError):
        sys.stderr.write("".join(out))
        sys.stderr.flush()


def _main(argv: list[str]) -> int:
    # Evaluated once, up front: an `except` clause's expression runs while an
    # interrupt unwinds through it, and this one imports (numpy, half-loaded then).
    bad_input = bad_input_types()
    try:
        parser = build_parser(argv)
    except bad_input as exc:  # a command's option table needs a missing extra
        print(f"hicache-cp: error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    args = parser.parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prog = f"hicache-cp {args.command}"
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
        return int(module.run(args))
    except bad_input as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except IntegrityFailure as exc:
        print(f"{prog}: integrity failure: {exc}", file=sys.stderr)
        return ExitCode.INTEGRITY
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: a bug, reported with its code
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(f"{prog}: internal error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return ExitCode.INTERNAL


if __name__ == "__main__":
    sys.exit(main())
