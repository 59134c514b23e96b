"""Import-only stand-in for `cutlass.cute.nvgpu` (see `cutlass._absent`)."""

from cutlass._absent import module_getattr

__getattr__ = module_getattr(__name__)
