"""Everything JAX-specific on the trainer side."""
