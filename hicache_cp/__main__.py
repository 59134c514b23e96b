import sys

from hicache_cp.cli import main

sys.exit(main())
