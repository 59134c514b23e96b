"""Import-only stand-in for the CUTLASS DSL's `cutlass` package (see `_absent`)."""

from cutlass._absent import module_getattr

__getattr__ = module_getattr(__name__)
