"""Stand-in for `sgl_kernel.kvcacheio`, the HiCache transfer ops built from sgl-kernel's
`csrc/kvcacheio/transfer.cu` (see `sgl_kernel._not_built`, reason "hicache-transfer").

`get_device_accessible_ptr` is left out on purpose: SGLang imports it under
`except ImportError` and then uses raw host addresses, which CUDA's unified
addressing makes valid for kernels (pool_host/common.py).
"""

from sgl_kernel._not_built import export

export(globals(), __name__, {
    "hicache-transfer": ("transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
                         "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
                         "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
                         "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
                         "transfer_kv_per_layer_ph_lf"),
    "other-model": ("transfer_embedding_ranges_direct",),
})  # fmt: skip
