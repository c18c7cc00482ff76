"""Generated from protos/sidecar/v1/*.proto by grpcio-tools; do not edit."""
