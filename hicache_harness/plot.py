"""Replay plots (optional dependency: ``pip install hicache-cp[plot]``).

matplotlib is imported lazily, with the non-interactive Agg backend, only when
a plot is drawn: the rest of the package never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache_harness.outputs import atomic_path

SAMPLE_KEYS = (
    "request",
    "hit_rate",
    "l1_used_pages",
    "l1_capacity",
    "l2_used_pages",
    "l2_capacity",
)
"""Keys every replay sample must carry."""


def _pyplot() -> Any:
    """Import ``matplotlib.pyplot`` on the Agg backend, or explain how to get it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "plotting needs matplotlib, which is not installed: "
            "run `pip install hicache-cp[plot]`"
        ) from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_replay(
    samples: Sequence[Mapping[str, float]], path: str | os.PathLike[str]
) -> Path:
    """Write a two-panel PNG of a replay to ``path`` and return the path.

    ``samples`` holds one mapping per sampled request with the keys of
    :data:`SAMPLE_KEYS`: ``request`` (request index), ``hit_rate`` (cumulative
    hit rate so far, 0..1), and the used and total pages of L1 and L2. Top
    panel: cumulative hit rate over requests; bottom panel: L1 and L2
    occupancy (used / capacity) over requests. A tier with capacity 0 is
    drawn as occupancy 0.

    Raises ``ValueError`` for no samples or a sample missing a key (naming the
    sample and the keys), ``ImportError`` with the install command when
    matplotlib is missing. The figure is closed before returning.
    Complexity: O(len(samples)).
    """
    if not samples:
        raise ValueError("plot_replay needs at least one sample")
    for i, s in enumerate(samples):
        missing = [k for k in SAMPLE_KEYS if k not in s]
        if missing:
            raise ValueError(f"sample {i} lacks keys {missing} (needs {list(SAMPLE_KEYS)})")

    def frac(used: float, cap: float) -> float:
        return used / cap if cap > 0 else 0.0

    xs = [float(s["request"]) for s in samples]
    hit = [float(s["hit_rate"]) for s in samples]
    l1 = [frac(s["l1_used_pages"], s["l1_capacity"]) for s in samples]
    l2 = [frac(s["l2_used_pages"], s["l2_capacity"]) for s in samples]

    plt = _pyplot()
    fig, (ax_hit, ax_occ) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    try:
        ax_hit.plot(xs, hit, color="tab:blue")
        ax_hit.set_ylabel("cumulative hit rate")
        ax_hit.set_ylim(0.0, 1.0)
        ax_hit.grid(True, alpha=0.3)
        ax_occ.plot(xs, l1, label="L1 (device)", color="tab:orange")
        ax_occ.plot(xs, l2, label="L2 (host)", color="tab:green")
        ax_occ.set_ylabel("occupancy (used / capacity)")
        ax_occ.set_xlabel("request")
        ax_occ.set_ylim(0.0, 1.05)
        ax_occ.grid(True, alpha=0.3)
        ax_occ.legend(loc="lower right")
        fig.tight_layout()
        out = Path(path)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out
