"""Q6_K format core, NumPy reference and the compute backends (NumPy, CUDA via CuPy).

Import layer rule: ``q6serve.kernels`` imports nothing from ``q6serve.service`` or
``q6serve.client`` and knows nothing of gRPC, metrics or flag sources.
"""
