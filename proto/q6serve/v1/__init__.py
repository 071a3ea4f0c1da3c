"""Generated protobuf/gRPC stubs for package ``q6serve.v1`` (regenerate: ``make proto``)."""
