"""Moved to :mod:`sidecar._src.ckptfmt.orbax.write` (issue 36: a format is a sub-package).

Kept only until the modules that import it from here name ``ckptfmt.orbax.write``.
"""

from sidecar._src.ckptfmt.orbax.write import *  # noqa: F403
