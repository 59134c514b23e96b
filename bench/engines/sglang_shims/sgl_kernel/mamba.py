"""Stand-in for `sgl_kernel.mamba` (see `sgl_kernel._not_built`)."""

from sgl_kernel._not_built import export

export(globals(), __name__, {
    "other-platform": ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"),
})  # fmt: skip
