"""The ``sidecar`` command and what it runs: local clusters, launch, demo, k8s."""
