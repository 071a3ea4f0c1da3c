"""CUDA C++ sources of the Q6_K kernels and the one loader that compiles them (NVRTC via CuPy)."""

from . import launch  # noqa: F401  (first: its parts, which it imports last, read its settings)
