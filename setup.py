"""The one compiled module: `hicache_cp._hashes`, the CPU hashes of the restore checks.

Optional: where no C compiler is found the build goes on without it, and
`hicache_cp.checksum` and `hicache_cp.keys` compute the same bits with numpy
(`checksum.NATIVE` says which). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hicache_cp._hashes", ["hicache_cp/_hashes.c"], optional=True)])
