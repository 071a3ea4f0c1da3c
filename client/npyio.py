"""Arrays in and out of the command line: .npy and .npz files, bf16 included.

NumPy has no bfloat16 of its own; ``ml_dtypes.bfloat16`` is the dtype JAX, TensorFlow and
this client use. ``np.save`` writes such an array with the anonymous header type ``<V2``, which
``np.load`` gives back as raw 2-byte voids (``|V2``) even with ml_dtypes imported. So bf16
arrays are written here with the header type ``bfloat16``: read them with

    import ml_dtypes, numpy as np
    y = np.load("y.npy")          # dtype bfloat16 (without ml_dtypes imported: a TypeError)

and inputs are accepted in both spellings (``bfloat16``, and the ``|V2`` of ``np.save``).
Nothing is ever unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)


class InputError(ValueError):
    """An input file the command cannot use; the message says why and what to do."""


def load_array(spec: str | Path) -> np.ndarray:
    """The array in ``FILE.npy``, ``FILE.npz`` (holding one array) or ``FILE.npz:NAME``."""
    path, name = _split(str(spec))
    if not path:
        raise InputError("'' is empty: name a .npy or .npz file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic[:4] != b"PK\x03\x04" and magic != b"\x93NUMPY":  # zip (.npz), .npy
            raise InputError(f"{path}: not a .npy or .npz file (write it with np.save/np.savez)")
        loaded = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: a directory, not a .npy/.npz file") from None
    except InputError:
        raise
    except (ValueError, TypeError, OSError) as e:  # truncated, pickled, an unknown dtype
        raise InputError(f"{path}: not a readable .npy/.npz file ({e})") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            names = list(loaded.files)
            if name is None:
                if len(names) != 1:
                    raise InputError(f"{path} holds {len(names)} arrays ({', '.join(names)}): "
                                     f"name one as {path}:NAME")
                name = names[0]
            if name not in names:
                raise InputError(f"{path} has no array {name!r} (it has {', '.join(names)})")
            loaded = loaded[name]
    elif name is not None:
        raise InputError(f"{path}: :NAME picks an array of an .npz file; this is one .npy")
    if loaded.dtype.kind == "V" and loaded.dtype.itemsize == 2 and loaded.dtype.names is None:
        loaded = loaded.view(BF16)  # what np.save writes for an ml_dtypes.bfloat16 array
    return loaded


def _split(spec: str) -> tuple[str, str | None]:
    """``FILE.npz:NAME`` -> (FILE.npz, NAME); anything else is a path as it is."""
    head, sep, tail = spec.rpartition(":")
    if sep and head.lower().endswith(".npz") and tail and "/" not in tail:
        return head, tail
    return spec, None


def float_matrix(a: np.ndarray, what: str, *, rows_of_1d: bool = True,
                 to: np.dtype[Any] | None = None, hint: str = "") -> np.ndarray:
    """``a`` as a 2-D f32/f16/bf16 array ([K] becomes [1, K] when ``rows_of_1d``); ``to``
    converts any float input (float64 included) to that dtype; ``hint`` says how to fix a
    dtype that is refused."""
    if to is not None and (a.dtype.kind == "f" or a.dtype == BF16):
        a = a.astype(to, copy=False)
    if a.dtype not in FLOAT_DTYPES:
        raise InputError(f"{what}: need float32, float16 or bfloat16 values, got {a.dtype}"
                         + (f" ({hint})" if hint else ""))
    if a.ndim == 1 and rows_of_1d:
        a = a[None, :]
    if a.ndim != 2:
        raise InputError(f"{what}: need a 2-D matrix, got shape {a.shape}")
    return a


def save_array(path: str | Path, a: np.ndarray) -> None:
    """``np.save`` to ``path`` as named (np.save adds '.npy' to a name without it), except
    that bf16 is written with the header type ``bfloat16`` (above)."""
    if a.dtype != BF16:
        with open(path, "wb") as f:
            np.save(f, a, allow_pickle=False)
        return
    a = np.ascontiguousarray(a)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "bfloat16", "fortran_order": False, "shape": a.shape})
        f.write(a.astype(BF16.newbyteorder("<"), copy=False).tobytes())
