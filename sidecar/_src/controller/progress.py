"""Progress bars on long waits: the controller's name for :mod:`sidecar._src.core.progress`
(which the arena's Worker uses too, for its place in a pool's admission queue)."""

from sidecar._src.core.progress import enabled, in_notebook, lines, queued, waiting

__all__ = ["enabled", "in_notebook", "lines", "queued", "waiting"]
