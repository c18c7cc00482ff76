"""Testing helpers: a whole multi-host deployment on one machine."""

from sidecar._src.tools.local import LocalCluster

__all__ = ["LocalCluster"]
