"""Stand-in for `sgl_kernel.elementwise` (see `sgl_kernel._not_built`)."""

from sgl_kernel._not_built import export

export(globals(), __name__, {"dense-model": ("copy_to_gpu_no_ce",)})
