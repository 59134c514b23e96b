"""Stand-in for `sgl_kernel.flash_attn` (see `sgl_kernel._not_built`)."""

from sgl_kernel._not_built import export

export(globals(), __name__, {
    "attention-triton": ("build_bidirectional_block_ids", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                         "get_scheduler_metadata"),
})  # fmt: skip
