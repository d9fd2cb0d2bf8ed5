"""The numba.cuda backend: the `CudaRunner` (runner.py) and the serving machinery around the
kernels (kernels/): step staging (staging.py), device buffers (buffers.py), weights on the
device (device_weights.py, device_model.py), the launch sequence of a step (forward.py), CUDA
graphs (graphs.py), KV page moves (pages.py), the `KernelPlan` of kernel choices (plan.py), and
hybrid (qwen35) models' GDN weights, recurrent-state pool and forward (hybrid.py).

Importing this package imports nothing heavy; numba is imported by its submodules only, so
`ninfer.gpu.cuda.available.cuda_available()` can be asked anywhere without pulling numba in.
"""
