"""`hicache-cp node-segment`: the node tier's segments on this machine (docs/node-tier.md).

    hicache-cp node-segment list [--prefix P]   every segment: size, who maps it, what it holds
    hicache-cp node-segment show NAME           its header (layout, session, generation) and journal
    hicache-cp node-segment drop NAME           remove it (refused while a process maps it)

`--dir DIR` looks in DIR only (an engine's `node_segment_dir`).

A segment outlives its engine on purpose (a restarted engine adopts it);
`drop` is how an operator frees its memory when no engine will. An engine
removes its own at an orderly shutdown with `node_drop_on_close = true`.
Reads headers without mapping (`pread`) and takes no lock that could block
an engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from hicache_harness.errors import ExitCode, InputError
from hicache_cp.node.geometry import ENTRY, HEADER_BYTES
from hicache_cp.node.journal import COMMITTED
from hicache_cp.node.segment import Header
from hostmem.segment import SegmentBusy, check_name, drop_segment, find_segment, list_segments, mapping_pids


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, help="the directory of the segments (default: /dev/shm and hugetlbfs mounts)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="every segment on this machine")
    ls.add_argument("--prefix", default="", help="only names starting with this")
    ls.add_argument("--json", action="store_true", help="one JSON object a line")
    show = sub.add_parser("show", help="one segment's header and journal")
    show.add_argument("name")
    drop = sub.add_parser("drop", help="remove a segment no process maps")
    drop.add_argument("name")


def describe(name: str, directory: Path | None = None) -> dict[str, Any]:
    """What segment `name` holds, read (not mapped, not locked) from its file. InputError
    when there is none."""
    path = find_segment(check_name(name), directory)
    if path is None:
        raise InputError(f"no segment {name!r} in /dev/shm or a hugetlbfs mount")
    with open(path, "rb") as f:
        head = Header.parse(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"))
        out: dict[str, Any] = {"name": name, "path": str(path), "bytes": path.stat().st_size,
                               "users": mapping_pids(path), "state": head.state.name.lower(),
                               "generation": head.generation, "session": head.session, "adopted": head.adopted,
                               "layout": head.description}  # fmt: skip
        desc = head.description
        if desc:
            entries = (int(desc["physical_pages"]) - 1) * int(desc["cp_size"]) + 1  # type: ignore[call-overload]
            raw = f.read(entries * ENTRY.itemsize)
            out["committed_pages"] = int((np.frombuffer(raw, ENTRY, len(raw) // ENTRY.itemsize)["state"] == COMMITTED).sum())
    return out


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        for info in list_segments(args.prefix, args.dir):
            try:
                d = describe(info.name, args.dir)
            except (InputError, OSError):
                continue  # removed meanwhile
            if d["state"] == "empty" and not d["layout"]:
                continue  # not a hicache-cp segment
            if args.json:
                print(json.dumps(d, sort_keys=True))
            else:
                model = d["layout"].get("model", "-") if d["layout"] else "-"
                print(f"{d['name']}  {d['bytes'] / 2**30:.2f} GiB  {d['state']}  generation {d['generation']}  "
                      f"model {model}  committed pages {d.get('committed_pages', 0)}  "
                      f"users {','.join(map(str, d['users'])) or 'none'}")  # fmt: skip
        return ExitCode.OK
    if args.action == "show":
        print(json.dumps(describe(args.name, args.dir), indent=2, sort_keys=True))
        return ExitCode.OK
    try:
        removed = drop_segment(check_name(args.name), args.dir)
    except SegmentBusy as exc:
        raise InputError(str(exc)) from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not removed:
        raise InputError(f"no segment {args.name!r} in /dev/shm or a hugetlbfs mount")
    print(f"removed {args.name}")
    return ExitCode.OK
