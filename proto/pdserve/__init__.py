"""pdserve's gRPC contracts: `.proto` sources and their generated Python stubs (`pdserve.v1`)."""
