"""The Gateway API Inference Extension's side of pdserve: an endpoint picker (docs/gateway.md)."""
