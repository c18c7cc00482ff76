"""What a controller made (feeds, streams, checkpointers): cancelled, closed and listed by it.

Who creates, closes: a :class:`~sidecar._src.controller.controller.Controller` closes the
feeds, streams and checkpointers it handed out when it closes, feeds and streams first
(:meth:`Children.cancel`, also on a host's loss), then the checkpointers, each of which
waits for its save in flight. They are held weakly: one its user dropped is not kept.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from sidecar._src.controller import feed as feed_lib
from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.feed import Feed
from sidecar._src.core import errors

log = logging.getLogger(__name__)


class Children:
  """The feeds, streams and checkpointers one controller made."""

  def __init__(self) -> None:
    self._made: weakref.WeakSet = weakref.WeakSet()

  def add(self, child: Any) -> None:
    self._made.add(child)

  def cancel(self) -> None:
    """Closes every feed and stream: work in flight stops."""
    for child in list(self._made):
      if not isinstance(child, Checkpointer):
        child.close()

  def close(self, lost_hosts: Callable[[], Mapping[int, str]]) -> None:
    """Closes each (the checkpointers: each waits for its save in flight). What closing
    one raises (a checkpointer's failed save nobody was told of) is logged, and the
    others are closed all the same; ``lost_hosts``: the hosts known lost, ``{id: why}``."""
    for child in list(self._made):
      try:
        child.close()
      except Exception as e:  # a failed save nobody was told of: said here, all closed
        _unreported(e, lost_hosts)

  def saved(self, data_state: Any) -> None:
    """A checkpointer saved with ``data_state``: each open feed whose position it is lets
    its sidecars drop the batches kept from before it (``Feed.saved``)."""
    for child in list(self._made):
      if isinstance(child, Feed):
        child.saved(data_state)

  def open_feeds(self) -> list[str]:
    """The names of the feeds open now."""
    return [c.name for c in list(self._made)
            if isinstance(c, Feed) and c.status is feed_lib.State.OPEN]

  def open_checkpointers(self) -> list[str]:
    """The directories of the checkpointers not closed yet."""
    return [c.directory for c in list(self._made)
            if isinstance(c, Checkpointer) and not c._closed]


def _unreported(e: Exception, lost_hosts: Callable[[], Mapping[int, str]]) -> None:
  """Logs what closing a child raised (a checkpointer's failed save its own save(),
  wait() or close() did not raise: one the trainer left to this controller, or whose
  training an elastic retry gave up); one of a host known lost, calmly."""
  lost = isinstance(e, errors.HostLostError) and e.host_id in lost_hosts()
  log.log(logging.WARNING if lost else logging.ERROR, "%s: %s%s", type(e).__name__, e,
          "".join(f"; {n}" for n in getattr(e, "__notes__", ())))
