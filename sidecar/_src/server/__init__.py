"""Code that runs in the sidecar process."""
