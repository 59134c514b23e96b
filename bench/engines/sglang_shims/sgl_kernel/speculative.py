"""Stand-in for `sgl_kernel.speculative` (see `sgl_kernel._not_built`)."""

from sgl_kernel._not_built import export

export(globals(), __name__, {"no-speculative": ("reconstruct_indices_from_tree_mask",)})
