"""The fast CPU backend (`--backend cpu`): the reference runner's forward over numba kernels
that read the GGUF blocks in place (`runner.py`); the numpy reference backend stays the oracle."""
