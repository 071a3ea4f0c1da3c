"""The names the wire's enums go by in the client: the keys of the client core's tables
(:mod:`.core`) and the command line's choices. Standard library only: the CLI builds its
parsers from these without importing gRPC or NumPy."""

from __future__ import annotations

DTYPES = ("f32", "f16", "bf16")  # Tensor.dtype and MatmulRequest.out_dtype
PRECISIONS = ("auto", "exact", "f16", "q8_1")  # MatmulRequest.precision
PLACEMENTS = ("shard", "replicate")  # LoadWeightsRequest.placement (unset: the worker's)
