"""Pick a backend by name. ``auto`` means CUDA when a GPU is usable, else NumPy."""

from __future__ import annotations

from .api import Backend
from .errors import InvalidArgument, Unavailable

BACKENDS = ("auto", "numpy", "cuda")


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "not here"
        return False


def make_backend(name: str = "auto", device: int = 0) -> Backend:
    """Build the named backend; ``cuda`` without a usable GPU raises Unavailable (no fallback)."""
    if name not in BACKENDS:
        raise InvalidArgument(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if not cuda_available():
        raise Unavailable("backend 'cuda' was asked for but no CUDA device is usable here "
                          "(is cupy-cuda12x/13x installed and a GPU visible?)")
    from .cuda_backend import CudaBackend

    return CudaBackend(device)
