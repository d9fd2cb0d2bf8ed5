"""The CUDA kernels, one module per family, each with its numpy oracle (`*_ref`) beside it and
its `ptx_cases()` (the compiled signatures tests/test_ptx.py builds for sm_90 and sm_120a).

    intrinsics   PTX instructions numba does not wrap, with simulator twins
    pdl          which kernels may start early in a captured graph (programmatic launch)
    quant_layout weights repacked into device planes; dequant, qdot: per-block arithmetic
    embed, norm, act_quant, swiglu, rope      the small kernels of a layer
    gemv, gemv_folds, gemm                    the linears (decode GEMV, folds, prefill GEMM)
    attn_decode, attn_lp, attn_prefill, flash attention
    sampler      on-device sampling
    gdn          Gated DeltaNet (Qwen3.5 linear attention): causal conv1d, delta rule, gated norm
    gated_attn   Qwen3.5's gated attention (q/gate split, partial RoPE, sigmoid gate); padded-vocab mask
"""
