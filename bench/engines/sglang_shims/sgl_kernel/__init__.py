"""Import-only stand-in for sgl-kernel 0.4.10's top-level names (see `_not_built` and
bench/engines/sglang_shims/README.md): packed as `sgl_kernel/` for the device machine only."""

from sgl_kernel._not_built import export

export(globals(), __name__, {
    "fused-op-torch": ("fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul", "gemma_fused_add_rmsnorm",
                       "gemma_rmsnorm", "rmsnorm", "silu_and_mul"),
    "sampling-pytorch": ("min_p_sampling_from_probs", "top_k_renorm_prob", "top_k_top_p_sampling_from_probs",
                         "top_p_renorm_prob"),
    "attention-triton": ("flash_mla_decode", "flash_mla_decode_get_workspace_size", "flash_mla_get_workspace_size",
                         "flash_mla_prefill", "flash_mla_prefill_get_workspace_size", "flash_mla_sparse_fwd",
                         "flash_mla_with_kvcache", "merge_state_v2"),
    "dense-model": ("biased_topk", "cutlass_w4a8_moe_mm", "es_fp8_blockwise_scaled_grouped_mm",
                    "es_sm100_mxfp8_blockscaled_grouped_mm", "es_sm100_mxfp8_blockscaled_grouped_quant",
                    "fp8_blockwise_scaled_grouped_mm", "fused_experts", "get_cutlass_w4a8_moe_mm_data", "hash_topk",
                    "minimax_decode_topk", "moe_fused_gate", "moe_sum", "moe_sum_reduce", "shuffle_rows",
                    "silu_and_mul_clamp", "topk_sigmoid", "topk_softmax"),
    "unquantized": ("int8_scaled_mm", "sgl_per_tensor_quant_fp8", "sgl_per_token_quant_fp8"),
    "no-speculative": ("build_tree_kernel_efficient", "verify_tree_greedy"),
    "other-platform": ("assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
                       "assign_req_to_token_pool_cpu", "build_draft_decode_metadata_cpu",
                       "build_tree_kernel_efficient_cpu", "concat_mla_k", "copy_all_layer_kv_cache_cpu",
                       "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotary_embedding",
                       "rotate_input_ids_cpu", "store_cache_xpu", "verify_tree_greedy_cpu"),
    "other-model": ("compress_norm_rope_store", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused",
                    "fast_topk_v2", "flash_compress128_decode", "flash_compress128_prefill", "flash_compress4_decode",
                    "flash_compress4_prefill", "fp8_mqa_logits", "fp8_paged_mqa_logits", "fp8_paged_mqa_logits_triton",
                    "fused_hc_head", "fused_inplace_qknorm_rope", "fused_k_norm_rope_flashmla",
                    "fused_q_indexer_rope_hadamard_quant", "fused_q_norm_rope", "gdn_attention", "gelu_quick",
                    "hadamard_transform", "hc_post", "hc_split_sinkhorn", "infllmv2_attn_stage1",
                    "max_pooling_1d_varlen", "mhc_fused_post_pre", "mhc_pre", "plan_compress_decode",
                    "plan_compress_decode_legacy", "plan_compress_prefill", "plan_compress_prefill_legacy", "top_k"),
    "no-hisparse": ("load_cache_to_device_buffer_dsv4_mla", "load_cache_to_device_buffer_mla"),
    "no-cuda-graph": ("weak_ref_tensor",),
    "no-grammar": ("apply_token_bitmask_inplace_cuda",),
    "no-pd-multiplexing": ("spatial",),
})  # fmt: skip
