"""Orbax integration: a feed's data position as an item of an Orbax checkpoint.

Example::

  mngr.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), data=sidecar.orbax.FeedStateSave(feed.state())))
"""

from sidecar._src.feed_checkpoint import FeedStateHandler, FeedStateRestore, FeedStateSave

__all__ = ["FeedStateHandler", "FeedStateRestore", "FeedStateSave"]
