"""gRPC plumbing shared by every process: auth, channels, codegen, proto <-> Python types."""
