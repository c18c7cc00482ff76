"""Moved to :mod:`sidecar._src.ckptfmt.orbax.commit` (issue 36: a format is a sub-package).

Kept only until the modules that import it from here name ``ckptfmt.orbax.commit``.
"""

from sidecar._src.ckptfmt.orbax.commit import *  # noqa: F403
