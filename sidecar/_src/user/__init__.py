"""What registered code imports: the registry, the pipeline context, sidecar.empty."""
