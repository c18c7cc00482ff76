"""Kubernetes support: render JobSets with the sidecar, and check manifests offline."""
