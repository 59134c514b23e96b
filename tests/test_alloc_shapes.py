"""bench/scripts/alloc_shapes.py: the descriptor count against hand-made page lists, and
the recorder around a real engine (a tiny `hicache-cp replay`, CPU, about a second)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "scripts"))

import alloc_shapes as A  # noqa: E402

from hicache_cp.io.base import CopyEngine, Direction  # noqa: E402


@pytest.mark.parametrize(("device", "host", "want", "want_sorted", "want_device"), [
    ([1, 2, 3], [7, 8, 9], 1, 1, 1),  # one run on both sides
    ([1, 2, 3], [7, 9, 10], 2, 2, 1),  # the host side breaks it
    ([4, 5, 9, 10], [0, 1, 2, 3], 2, 2, 2),  # the device side breaks it
    ([3, 2, 1], [9, 8, 7], 3, 1, 3),  # descending: every page its own descriptor, unless sorted
    ([5, 6, 7, 1], [10, 11, 3, 2], 3, 3, 2),  # coalesce_pairs' own example
    ([], [], 0, 0, 0),
])  # fmt: skip
def test_descriptors_count_runs_consecutive_on_both_sides(device, host, want, want_sorted, want_device):
    d, h = np.array(device, np.int64), np.array(host, np.int64)
    assert A.descriptors(d, h) == want
    assert A.sorted_descriptors(d, h) == want_sorted
    assert A.device_runs(d) == want_device


def test_summary_counts_per_direction():
    ops = [A.OpShape.of(Direction.D2H, np.array([1, 2, 3]), np.array([7, 8, 9])),
           A.OpShape.of(Direction.D2H, np.array([1, 2, 3]), np.array([7, 9, 10])),
           A.OpShape.of(Direction.H2D, np.array([4]), np.array([0])),
           A.OpShape.of(Direction.H2D, np.array([], np.int64), np.array([], np.int64))]  # fmt: skip
    s = A.summarise(ops)
    assert s["d2h"]["ops"] == 2 and s["d2h"]["pages_per_op"] == 3
    assert s["d2h"]["descriptors"] == {"per_op": 1.5, "p50": 1.5, "p90": 1.9, "pages_per": 2.0, "one": 0.5}
    assert s["d2h"]["device_runs"]["one"] == 1.0
    assert s["h2d"]["ops"] == 1  # the op without pages is left out


def test_recorder_records_every_op_of_a_tiny_replay_and_restores_the_engine():
    real = CopyEngine.plan
    shape = A.Shape(None, 12, 64, 256)
    ops = A.run_replay(shape, shape.requests())
    assert CopyEngine.plan is real
    backups = [o for o in ops if o.direction == "d2h"]
    assert backups, "a replay of 12 requests backs up the pages it computed"
    assert all(0 < o.descriptors <= o.pages and o.device_runs <= o.descriptors for o in backups), backups
    assert A.summarise(ops)["d2h"]["ops"] == len(backups)
