"""`python -m hicache_cp ...`: the CLI (an entry point, part of the harness layer)."""

import sys

from hicache_cp.harness.cli import main

sys.exit(main())
