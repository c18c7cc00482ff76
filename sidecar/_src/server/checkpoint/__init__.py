"""The sidecar's half of checkpointing: stage, persist, commit, replicate, read."""
