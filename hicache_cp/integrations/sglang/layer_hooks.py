"""The per-layer hooks inside SGLang's forward: loads waited on, backups submitted.

SGLang's KV pools call `layer_transfer_counter.wait_until(layer)` each time
attention fetches a layer's KV buffer (`get_key_buffer`, `get_value_buffer`),
and the TP worker calls `set_consumer(index)` on the counter registered with
it at the start of every forward. `LayerHooks` is that counter, one per
model (the target's pool and the MTP draft's pools each get their own), and
`ForwardCopies` is what one forward owes:

    stage_load(op) / stage_backups(ops)    from init_load_back / maybe_hand_to_session,
                                           before the forward: staged for the next forward
    set_consumer (target, forward start)   staged -> current; the previous forward's
                                           remaining backup layers are submitted (its kernels
                                           are all enqueued by now); target state layer 0 waited
    wait_until(l) (model m)                loads: the forward waits for layer l of every part
                                           of m (on CUDA the compute stream waits on the
                                           layer's events; the host does not block), and for
                                           the target indexer's layer l+1 (the indexer reads it
                                           before layer l+1's attention asks for its KV); at the
                                           last target layer, every draft layer. Backups: layers
                                           [cursor, l) of m are written, so their D2H is
                                           submitted now, overlapped with layer l
    finish()                               the layers no hook reported (the last one of each
                                           model, or all under full CUDA-graph replay) are
                                           submitted after the forward

`consumer_index` is 0 while the current forward has loads (SGLang's CUDA
graph runner then waits for the last layer before a full replay) and -1
otherwise. Nothing here synchronises the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hicache_cp import BackupOp, HiCache, LoadOp, Model, Part

logger = logging.getLogger(__name__)


@dataclass
class _Forward:
    """One forward's copies: its loads to wait for, its backups and their per-model cursor."""

    loads: list[LoadOp] = field(default_factory=list)
    backups: list[BackupOp] = field(default_factory=list)
    submitted: dict[Model, int] = field(default_factory=lambda: {Model.TARGET: 0, Model.DRAFT: 0})
    finished: bool = False


class ForwardCopies:
    """The copies of the forward SGLang is running, and of the one being scheduled."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.layout = cache.layout
        self._staged = _Forward()
        self._current: _Forward | None = None
        self.fallback_layers = 0  # backup layers no hook reported (submitted after the forward)

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
        self._current, self._staged = self._staged, _Forward()
        if self._current.loads:
            self._wait(Part.TARGET_STATE, 0)

    @property
    def has_loads(self) -> bool:
        return self._current is not None and bool(self._current.loads)

    def reached(self, model: Model, layer: int) -> None:
        """Attention of `layer` of `model` fetches its KV (see the module docstring)."""
        fwd = self._current
        if fwd is None:
            return
        for op in fwd.loads:
            op.wait_layer(layer, model)
        if fwd.loads:
            if model is Model.TARGET:
                self._wait(Part.TARGET_STATE, layer + 1)
                if layer == self.layout.num_target_layers - 1:
                    for d in range(self.layout.num_draft_layers):
                        for op in fwd.loads:
                            op.wait_layer(d, Model.DRAFT)
        self._submit(fwd, model, min(layer, self.layout.num_layers(model)))

    def finish(self) -> None:
        """Submit what the hooks did not (after the forward; idempotent)."""
        fwd = self._current
        if fwd is None or fwd.finished:
            return
        fwd.finished = True
        missing = sum(self.layout.num_layers(m) - fwd.submitted[m] for m in Model) if fwd.backups else 0
        if missing:
            self.fallback_layers += missing
            logger.debug("hicache-cp: %d backup layers submitted after the forward", missing)
        for model in Model:
            self._submit(fwd, model, self.layout.num_layers(model))

    # ---- helpers ------------------------------------------------------------------------

    def _submit(self, fwd: _Forward, model: Model, upto: int) -> None:
        """D2H of layers [cursor, upto) of `model` for the forward's backups."""
        first = fwd.submitted[model]
        if upto <= first:
            return
        fwd.submitted[model] = upto
        if not fwd.backups:
            return
        for layer in range(first, upto):
            self.cache.on_layer_end(model, layer, fwd.backups)

    def _wait(self, part: Part, layer: int) -> None:
        if not self.layout.has_part(part) or not self.layout.part(part).has_layer(layer) or self._current is None:
            return
        for op in self._current.loads:
            op.wait_part(part, layer)


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
