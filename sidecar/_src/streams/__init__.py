"""The one stream consumer and its transports (gRPC, the worker's socket)."""
