"""Lab equipment for the CUDA backend, outside the installed package (run from the repository
root on a GPU machine; scripts/device_run.sh runs them by stage):

    python -m tools.profile     where a decode step's time goes; A/B of KernelPlans (--variant)
    python -m tools.gemv_tune   single GEMV / GEMM / RMSNorm / sampler kernels at model shapes
    python -m tools.attn_tune   the decode attention paths, us a layer
    tools/trace.py              CUPTI kernel timeline of a captured graph (profile --trace)

The kernel checks and the PTX build are tests: tests/cuda/.
"""
