"""`hicache-cp bench-pd --overlap`: forward's end to decode holding all KV, per layer vs after insert.

Runs in one process on loopback, like `bench-pd`: a `DecodePeer` on a thread
(its own engine) and a `PdSender` over an L1 `DevicePool` (on `--device`)
and an L2 `HostPool`. One request of `--pages` pages (a share `--l2-fraction`
of them L2-only) goes through a stand-in forward of every target and draft
layer, `--layer-ms` each: on CUDA a real kernel (bf16 matmuls on the compute
stream, calibrated to that time), on CPU a wait (the host is idle during a
GPU forward; on 2 cores a busy loop would only starve the engine's threads).
The KV bytes are written once before the runs; the decode peer verifies
every byte of every run.

    after_insert  the forward runs, then (at its end, as a server does after
                  insert) every part and layer is sent and waited
    per_layer     each layer's hook submits that layer of its model's parts
                  (`send_layer(after=event)`, off the forward's thread once
                  the layer's kernels are done); "done" after the last layer

Per run: ``ready_s`` = forward's end (the last layer complete) -> the last
batch landed at the decode peer (`RoomResult.ready_s`), and ``forward_s``
(the forward's own time, to show the per-layer submissions do not slow it).
Modes alternate run by run; medians and the ratio per_layer / after_insert
go to the table and `--json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from hicache_cp.cp import mapping as cp_mapping
from hicache_harness import integrity
from hicache_harness.decode_peer import DecodePeer
from hicache_harness.errors import ExitCode
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.layout import KVLayout, Model
from hicache_cp.pd.control import new_authkey

MODES = ("after_insert", "per_layer")
WARMUP = 1


class StandInForward:
    """`layer()` takes `layer_ms` of the device: kernels on CUDA, a wait on CPU."""

    def __init__(self, layer_ms: float, device: str) -> None:
        self.layer_ms = layer_ms
        self.cuda = device.startswith("cuda")
        self.reps = 0
        if self.cuda and layer_ms > 0:
            self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                self.a @ self.a
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                self.a @ self.a
            torch.cuda.synchronize()
            one_ms = (time.perf_counter() - t0) * 1000 / 50
            self.reps = max(1, round(layer_ms / one_ms))

    def layer(self) -> Any:
        """Run one layer; returns a completion marker (a CUDA event, or None)."""
        if self.cuda:
            for _ in range(self.reps):
                self.a @ self.a
            ev = torch.cuda.Event()
            ev.record()
            return ev
        if self.layer_ms > 0:
            time.sleep(self.layer_ms / 1000)
        return None


def _homes(args: argparse.Namespace, layout: KVLayout, l1: Any, l2: Any, pool_pages: int) -> Any:
    from hicache_cp.pd.sender import PageHomes

    n = args.pages
    rng = np.random.default_rng(args.seed)
    pos = np.arange(n, dtype=np.int64)
    tier = (pos < int(round(args.l2_fraction * n))).astype(np.int8)
    pages = np.zeros(n, dtype=np.int64)
    for t in (0, 1):
        k = int((tier == t).sum())
        phys = np.sort(rng.choice(np.arange(1, pool_pages), k, replace=False))
        pages[tier == t] = cp_mapping.to_logical(phys, 0, 1)
    hashes = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    for p in layout.parts:
        for slot, layer in enumerate(p.layer_ids):
            for t in (0, 1):
                sel = tier == t
                content = integrity.content(hashes[sel], p.part, layer, p.page_bytes)
                if t == 1:
                    l2.layer_view(p.part, slot)[pages[sel]] = content
                else:
                    idx = torch.from_numpy(pages[sel]).to(l1.device)
                    l1.layer(p.part, slot)[idx] = torch.from_numpy(content).to(l1.device)
    if l1.is_cuda:
        torch.cuda.synchronize()
    return PageHomes(pos, tier, pages, hashes)


def _run_once(mode: str, room_id: int, sender: Any, layout: KVLayout, homes: Any, fwd: StandInForward) -> Any:
    sender.open_room(room_id, room_id, len(homes))
    t0 = time.perf_counter()
    marker = None
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(layout.num_layers(model)):
            marker = fwd.layer()
            if mode == "per_layer":  # one submission per hook: this layer of the model's parts
                keys = [(part.part, layer) for part in layout.parts_of(model) if part.has_layer(layer)]
                sender.send_layers(room_id, keys, homes, after=marker, background=True)
    if mode == "per_layer":
        sender.mark_forward_end(room_id, after=marker)
    else:
        if marker is not None:
            marker.synchronize()  # the server's sync at the forward's end (it samples the first token)
        sender.mark_forward_end(room_id)
        sender.send(room_id, homes)
    res = sender.finish(room_id)
    forward_s = sender.rooms.get(room_id).forward_end - t0
    sender.rooms.forget(room_id)
    return res, forward_s


def run(args: argparse.Namespace, layout: KVLayout) -> int:
    from hicache_cp.pd.sender import PdSender
    from hicache_cp.pools import DevicePool, HostPool

    device = args.device
    n = args.pages
    pool_pages = n + 1
    authkey = new_authkey()
    peer = DecodePeer(layout, n + 1, authkey=authkey)
    peer.start()
    l1 = DevicePool(layout, pool_pages, device=device)
    l2 = HostPool(layout, layout.bytes_per_page * pool_pages)
    sender = PdSender(layout, l1, l2, decode_address=peer.address, authkey=authkey)
    try:
        homes = _homes(args, layout, l1, l2, pool_pages)
        fwd = StandInForward(args.layer_ms, device)
        ready: dict[str, list[float]] = {m: [] for m in MODES}
        forward: dict[str, list[float]] = {m: [] for m in MODES}
        room_id = 0
        for rep in range(args.repeats + WARMUP):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                room_id += 1
                res, forward_s = _run_once(mode, room_id, sender, layout, homes, fwd)
                if not res.ok or res.ready_s is None:
                    print(f"hicache-cp bench-pd: integrity failure: {mode} room {room_id}: {res.failure}",
                          file=sys.stderr)
                    return ExitCode.INTEGRITY
                if rep >= WARMUP:
                    ready[mode].append(res.ready_s)
                    forward[mode].append(forward_s)
        med = {m: statistics.median(ready[m]) for m in MODES}
        fwd_med = {m: statistics.median(forward[m]) for m in MODES}
        nbytes = res.nbytes
        layers = sum(layout.num_layers(m) for m in (Model.TARGET, Model.DRAFT))
        out = {
            "what": "forward's end -> every byte at the decode peer, per-layer vs after-insert PD",
            "ready_s_median": {m: round(v, 6) for m, v in med.items()},
            "ready_s_runs": {m: [round(x, 6) for x in ready[m]] for m in MODES},
            "forward_s_median": {m: round(v, 6) for m, v in fwd_med.items()},
            "ratio_per_layer_over_after_insert": round(med["per_layer"] / med["after_insert"], 4)
            if med["after_insert"] else None,
            "bytes": nbytes, "pages": n, "layers": layers, "layer_ms": args.layer_ms, "device": device,
            "l2_fraction": args.l2_fraction, "repeats": args.repeats, "layout": layout.describe(),
            "transport": "mooncake tcp 127.0.0.1", "forward": "cuda bf16 matmuls" if fwd.cuda else "wait",
            "commit": git_commit(), "machine": machine(), "command": command_line("bench-pd"),
        }
        print(f"{'mode':<14}{'ready (median)':>16}{'forward (median)':>18}  runs, ready s")
        for m in MODES:
            print(f"{m:<14}{med[m] * 1e3:>13.3f} ms{fwd_med[m] * 1e3:>15.3f} ms  "
                  f"{' '.join(f'{x * 1e3:.2f}' for x in ready[m])}")
        print(f"per_layer / after_insert = {out['ratio_per_layer_over_after_insert']}; {nbytes / 2**20:.1f} MiB, "
              f"{n} pages, {layers} layers x {args.layer_ms} ms on {device}")
        if args.json is not None:
            write_json(args.json, out)
        return 0
    finally:
        sender.close()
        peer.close()
        l2.close()
