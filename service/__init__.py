"""The gRPC worker: registry, VRAM accountant, batcher, flags, metrics and the wire edge.

Imports ``q6serve.kernels`` (downward) only; only ``service/wire*.py`` touch ``*_pb2``.
"""
