"""Confinement of server-side GGUF paths to ``--model-dir``.

A LoadWeights path is untrusted: it must name a file *inside* the model directory after every
symlink is followed. Absolute paths and ``..`` components are refused outright (even when they
would land inside), symlinks are resolved and the result must stay under the resolved model
dir. Paths that cannot be resolved (symlink loops, overlong names) are client errors, never
INTERNAL. What remains is a time-of-check/time-of-use window: whoever can write into the model
dir can swap a symlink between this check and the open, so the model dir must be writable only
by the operator (docs/RELIABILITY.md).
"""

from __future__ import annotations

from pathlib import Path

from q6serve.kernels.errors import FailedPrecondition, InvalidArgument, PermissionDenied

MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX of one component


def confine(model_dir: Path | None, rel: str) -> Path:
    """``rel`` resolved inside ``model_dir``; refuse anything that would leave it."""
    if model_dir is None:
        raise FailedPrecondition("this worker has no --model-dir; upload weights instead")
    if not rel:
        raise InvalidArgument("gguf path is empty")
    shown = repr(rel[:128]) + ("..." if len(rel) > 128 else "")
    if "\x00" in rel:
        raise InvalidArgument(f"gguf path {shown} contains a NUL byte")
    size = len(rel.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        raise InvalidArgument(f"gguf path is {size} bytes long; the limit is {MAX_PATH_BYTES}")
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        raise PermissionDenied(f"gguf path {shown} must be relative to the model dir "
                               "without '..'")
    long = [part for part in p.parts if len(part.encode("utf-8", "surrogatepass"))
            > MAX_NAME_BYTES]
    if long:
        raise InvalidArgument(f"gguf path component {long[0][:64]!r}... is longer than "
                              f"{MAX_NAME_BYTES} bytes")
    try:
        root = model_dir.resolve()
        full = (root / p).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise InvalidArgument(f"gguf path {shown} cannot be resolved: {e.__class__.__name__} "
                              f"({getattr(e, 'strerror', None) or 'symlink loop?'})") from None
    if not full.is_relative_to(root):
        raise PermissionDenied(f"gguf path {shown} leaves the model dir (symlink?)")
    return full
