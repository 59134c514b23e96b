"""`ForwardCopies.reached` (SGLang's per-layer hook): a forward with nothing to wait for
or submit returns before anything else (no CUDA capture query); one with backups
still submits them in groups, asking about capture once per group, not per layer, and
no hook fires copies during a CUDA-graph capture."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

from hicache_cp import HiCache, Model  # noqa: E402
from hicache_harness.sglang.env import import_sglang  # noqa: E402

import_sglang()  # SGLang first, as every SGLang test: the plug-in registers itself with SGLang's registry
from hicache_cp.integrations.sglang.layer_hooks import ForwardCopies  # noqa: E402

from conftest import tiny_config  # noqa: E402


class _Capture:
    """A stand-in for `torch.cuda.is_current_stream_capturing`: counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.capturing = False

    def __call__(self) -> bool:
        self.calls += 1
        return self.capturing


@pytest.fixture
def cache():
    c = HiCache(tiny_config(write_policy="write_through"))
    yield c
    c.drain()
    c.close()


def _copies(cache: HiCache) -> tuple[ForwardCopies, _Capture]:
    copies = ForwardCopies(cache)
    capture = _Capture()
    copies._capturing = capture
    return copies, capture


def _every_layer(copies: ForwardCopies, cache: HiCache) -> None:
    for model in Model:
        for layer in range(cache.layout.num_layers(model)):
            copies.reached(model, layer)


def test_a_forward_without_copies_asks_nothing_per_layer(cache: HiCache) -> None:
    copies, capture = _copies(cache)
    copies.begin()
    _every_layer(copies, cache)
    assert capture.calls == 0


def test_a_forward_with_backups_submits_every_layer_in_order(cache: HiCache) -> None:
    copies, capture = _copies(cache)
    tokens = np.arange(2 * cache.layout.page_size, dtype=np.int64)
    ops = cache.reserve_host_copy(tokens, np.array([1, 2]))
    assert ops
    copies.stage_backups(ops)
    copies.begin()
    submits: list[tuple[Model, int]] = []
    real_submit = copies._submit
    copies._submit = lambda fwd, model, upto: (submits.append((model, upto)), real_submit(fwd, model, upto))
    _every_layer(copies, cache)
    copies._submit = real_submit
    assert submits and capture.calls == len(submits)  # asked before each group's submission only
    assert copies._current.submitted[Model.TARGET] > 0 and ops[0].inflight  # groups went out during the forward
    copies.finish()
    assert not ops[0].missing_layers()
    copies.begin()  # the finished forward is replaced; its hooks asked nothing more
    calls = capture.calls
    _every_layer(copies, cache)
    assert capture.calls == calls


def test_hooks_during_a_capture_submit_nothing(cache: HiCache) -> None:
    copies, capture = _copies(cache)
    tokens = np.arange(cache.layout.page_size, dtype=np.int64)
    ops = cache.reserve_host_copy(tokens, np.array([3]))
    copies.stage_backups(ops)
    copies.begin()
    capture.capturing = True
    _every_layer(copies, cache)
    assert copies._current.submitted == {Model.TARGET: 0, Model.DRAFT: 0} and not ops[0].inflight
    capture.capturing = False
    copies.finish()  # everything goes after the forward instead
    assert not ops[0].missing_layers()
