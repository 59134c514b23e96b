#!/usr/bin/env python
"""Moved to `hicache-cp bench-pinning` (hicache_cp/harness/bench/pinning.py); this forwards to it.

Same options as before (--gib, --copy-gib, --chunk-gib, --json) plus the new
ones; see `python -m hicache_cp.harness.bench.pinning --help`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_cp.harness.bench.pinning import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
