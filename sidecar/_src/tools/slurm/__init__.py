"""Slurm: ``sidecar slurm batch|service|status|stop`` (docs/slurm.md)."""
