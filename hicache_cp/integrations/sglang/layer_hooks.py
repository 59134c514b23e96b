"""The per-layer hooks inside SGLang's forward: loads waited on, backups submitted.

SGLang's KV pools call `layer_transfer_counter.wait_until(layer)` each time
attention fetches a layer's KV buffer (`get_key_buffer`, `get_value_buffer`),
and the TP worker calls `set_consumer(index)` on the counter registered with
it at the start of every forward. `LayerHooks` is that counter, one per
model (the target's pool and the MTP draft's pools each get their own), and
`ForwardCopies` is what one forward owes:

    stage_load(op) / stage_backups(ops)    staged for the next forward
    set_consumer (target, forward start)   the previous forward's remaining backup layers
                                           are submitted (its kernels are all enqueued by
                                           now); `prepare` submits what the scheduler staged
                                           (the radix cache's loads and reservations, on the
                                           forward's stream, behind the forward before it);
                                           staged -> current; read-ahead parts' layer 0 waited
    wait_until(l) (model m)                loads: the forward waits for layer l of every part
                                           of m (on CUDA the compute stream waits on the
                                           layer's events; the host does not block), for the
                                           read-ahead parts' layer l+1 (the DSA indexer reads
                                           its keys before layer l+1's attention asks for KV),
                                           and, at the last target layer, for every draft
                                           layer. Backups: when layer l follows layer l-1 in
                                           order, layers [cursor, l) of m are written; once
                                           they make a group (`backup_layer_group`: about
                                           1/`backup_submits_per_forward` of m's layers)
                                           their D2H is submitted, one
                                           engine call per op, overlapped with what follows
    finish()                               the layers not submitted yet (each model's last
                                           group, or all under a full CUDA-graph replay)
                                           are submitted after the forward, and the loads'
                                           restore checks pinned behind it (`HiCache.loads_read`)

Only hooks that arrive in layer order are evidence that earlier layers were
written. SGLang's full prefill CUDA-graph replay calls `wait_until(last
layer)` once before the replay, when `consumer_index >= 0`, and no hook
inside it: that call waits for every load and submits no backup (they all
go after the forward, from `finish`). Hooks that fire while a CUDA graph is
being captured belong to no forward and are ignored.

`consumer_index` is 0 while the current forward has loads (SGLang's CUDA
graph runner then waits for the last layer before a full replay) and -1
otherwise; the index SGLang passes to `set_consumer` is not used: every
forward start is a boundary. Nothing here synchronises the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache_cp import BackupOp, HiCache, LoadOp, Model, Part, backup_layer_group

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """One forward's copies: its loads to wait for, its backups, and per model the backup
    cursor and the last layer whose hook arrived in order."""

    loads: list[LoadOp] = field(default_factory=list)
    backups: list[BackupOp] = field(default_factory=list)
    submitted: dict[Model, int] = field(default_factory=lambda: {Model.TARGET: 0, Model.DRAFT: 0})
    in_order: dict[Model, int] = field(default_factory=lambda: {Model.TARGET: -1, Model.DRAFT: -1})
    finished: bool = False


class ForwardCopies:
    """The copies of the forward SGLang is running, and of the one being scheduled.

    `read_ahead`: parts read before their layer's hook (the DSA indexer's keys).
    `prepare`: called at each forward's start, before the swap, to stage what
    the scheduler deferred to it (the radix cache's loads and reservations)."""

    def __init__(
        self,
        cache: HiCache,
        read_ahead: frozenset[Part] = frozenset(),
        prepare: Callable[[], None] | None = None,
        cuda: bool = False,
    ) -> None:
        self.cache = cache
        self.layout = cache.layout
        self.read_ahead = read_ahead
        self.prepare = prepare
        self._capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing if cuda else _never
        self._layers = {m: self.layout.num_layers(m) for m in Model}
        submits = cache.config.backup_submits_per_forward
        self._group = {m: backup_layer_group(n, submits) for m, n in self._layers.items()}
        self._last_target = self._layers[Model.TARGET] - 1
        self._staged = _Forward()
        self._current: _Forward | None = None
        self.fallback_layers = 0  # backup layers no hook reported (submitted after the forward)
        self.forwards = 0

    # ---- before the forward --------------------------------------------------------------

    def stage_load(self, op: LoadOp) -> None:
        self._staged.loads.append(op)

    def stage_backups(self, ops: list[BackupOp]) -> None:
        self._staged.backups.extend(ops)

    def forget(self, ops: list[BackupOp]) -> None:
        """Stop submitting layers for `ops` (their request left before its forward wrote them)."""
        for fwd in (self._staged, self._current):
            if fwd is not None:
                fwd.backups = [op for op in fwd.backups if op not in ops]

    # ---- inside the forward --------------------------------------------------------------

    def begin(self) -> None:
        self.finish()
        if self.prepare is not None:
            self.prepare()
        self._current, self._staged = self._staged, _Forward()
        self.forwards += 1
        if self._current.loads and Part.TARGET_STATE in self.read_ahead:
            self._wait(Part.TARGET_STATE, 0)

    @property
    def has_loads(self) -> bool:
        return self._current is not None and bool(self._current.loads)

    def reached(self, model: Model, layer: int) -> None:
        """Attention of `layer` of `model` fetches its KV (see the module docstring).

        O(1) without a CUDA call for a forward that has nothing to wait for or submit
        now (no loads, and no group of backup layers due): SGLang calls this once per
        layer. Capture is asked about only before a wait or a submission: a hook fired
        while a CUDA graph is captured may move the in-order cursor of the forward before
        it, which only decides when its layers go, and none goes during a capture."""
        fwd = self._current
        if fwd is None:
            return
        loads = fwd.loads
        if not loads and (fwd.finished or not fwd.backups):
            return  # (`_current.backups` never grows: staged backups join the next forward)
        if loads:
            if self._capturing():
                return
            for op in loads:
                op.wait_layer(layer, model)
            if model is Model.TARGET:
                if Part.TARGET_STATE in self.read_ahead:
                    self._wait(Part.TARGET_STATE, layer + 1)
                if layer == self._last_target:
                    for d in range(self._layers[Model.DRAFT]):
                        for op in loads:
                            op.wait_layer(d, Model.DRAFT)
        in_order = fwd.in_order
        if layer <= in_order[model] + 1:  # in order: every layer below `layer` was written
            if layer > in_order[model]:
                in_order[model] = layer
            upto = min(layer, self._layers[model])
            if upto - fwd.submitted[model] >= self._group[model] and (loads or not self._capturing()):
                self._submit(fwd, model, upto)

    def finish(self) -> None:
        """Submit what the hooks did not, and pin the forward's loads' restore checks
        behind it (after the forward; idempotent). On CUDA the caller's current stream
        must follow the forward and nothing enqueued after it (the next forward's start,
        or `fence.ForwardFence.behind_forward` on the scheduler thread): under overlap
        scheduling SGLang queues the next forward, and its own stream waits for it,
        before it processes this forward's results."""
        fwd = self._current
        if fwd is None or fwd.finished:
            return
        fwd.finished = True
        if fwd.loads:
            self.cache.loads_read(fwd.loads)
        missing = sum(self._layers[m] - fwd.submitted[m] for m in Model) if fwd.backups else 0
        if missing:
            self.fallback_layers += missing
            logger.debug("hicache-cp: %d backup layers submitted after the forward", missing)
        for model in Model:
            self._submit(fwd, model, self._layers[model])

    @property
    def unfinished(self) -> bool:
        """The current forward still has work after it: backup layers to submit, or its
        loads' checks to pin."""
        fwd = self._current
        return fwd is not None and not fwd.finished and bool(fwd.backups or fwd.loads)

    # ---- helpers ------------------------------------------------------------------------

    def _submit(self, fwd: _Forward, model: Model, upto: int) -> None:
        """D2H of layers [cursor, upto) of `model` for the forward's backups."""
        first = fwd.submitted[model]
        if upto <= first:
            return
        fwd.submitted[model] = upto
        if not fwd.backups:
            return
        self.cache.on_layers_end(model, range(first, upto), fwd.backups)

    def _wait(self, part: Part, layer: int) -> None:
        if self._current is None or not self.layout.has_part_layer(part, layer):
            return
        for op in self._current.loads:
            op.wait_part(part, layer)


def _never() -> bool:
    return False


class LayerHooks:
    """SGLang's `layer_transfer_counter` for one model's pool (see the module docstring)."""

    def __init__(self, copies: ForwardCopies, model: Model, first_layer: int = 0, num_layers: int | None = None) -> None:
        """`first_layer`: the model's layer id of this pool's local layer 0 (MTP layers
        spread over several draft pools are numbered across them)."""
        self.copies = copies
        self.model = model
        self.first_layer = first_layer
        self.num_layers = copies.layout.num_layers(model) if num_layers is None else num_layers

    @property
    def consumer_index(self) -> int:
        return 0 if self.copies.has_loads else -1

    def set_consumer(self, index: int) -> None:
        """The TP worker starts a forward (registered with it for the target only)."""
        if self.model is Model.TARGET:
            self.copies.begin()

    def wait_until(self, layer: int) -> None:
        self.copies.reached(self.model, self.first_layer + layer)

    def reset(self) -> None:
        """SGLang's counter API; the forward's state lives in `ForwardCopies`."""
