"""Moved to :mod:`sidecar._src.ckptfmt.orbax.read` (issue 36: a format is a sub-package).

Kept only until the modules that import it from here name ``ckptfmt.orbax.read``.
"""

from sidecar._src.ckptfmt.orbax.read import *  # noqa: F403
