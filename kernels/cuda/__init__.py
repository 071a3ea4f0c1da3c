"""CUDA C++ sources of the Q6_K kernels and the one loader that compiles them (NVRTC via CuPy)."""
