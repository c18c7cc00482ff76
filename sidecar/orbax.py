"""Orbax integration: keep ``ocp.CheckpointManager`` while the sidecars carry the bytes.

Example::

  handler = sidecar.orbax.SidecarCheckpointHandler(ctl)
  mngr = ocp.CheckpointManager(directory, item_names=("state", "data"),
                               item_handlers={"state": handler})
  mngr.save(step, args=ocp.args.Composite(
      state=sidecar.orbax.SidecarSave(state), data=sidecar.orbax.FeedStateSave(feed.state())))
"""

from sidecar._src.jax.feed_state import FeedStateHandler, FeedStateRestore, FeedStateSave
from sidecar._src.jax.orbax_handler import SidecarCheckpointHandler, SidecarRestore, SidecarSave

__all__ = [
    "FeedStateHandler",
    "FeedStateRestore",
    "FeedStateSave",
    "SidecarCheckpointHandler",
    "SidecarRestore",
    "SidecarSave",
]
