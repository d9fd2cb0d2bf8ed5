"""The numba.cuda backend: kernels, device buffers, CUDA graphs and the `CudaRunner`.

Importing this package imports nothing heavy; numba is imported by its submodules only, so
`ninfer.gpu.cuda.available.cuda_available()` can be asked anywhere without pulling numba in.
"""
