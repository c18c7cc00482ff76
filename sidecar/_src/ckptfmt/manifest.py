"""A committed step's manifest: now :mod:`sidecar._src.ckptfmt.records` (issue 36).

Kept only so that the trainer side's imports work until they name ``records``.
"""

from sidecar._src.ckptfmt.records import Manifest, SavedLeaf

__all__ = ["Manifest", "SavedLeaf"]
