"""A feed's position in an Orbax checkpoint, beside the model's state.

``feed.state()`` is a small JSON-serialisable dict. :class:`FeedStateHandler`
stores it as one JSON file in its item's directory, like Grain's own
``grain.checkpoint.CheckpointHandler`` stores an iterator's state, so that one
``CheckpointManager`` step holds both::

  mngr = ocp.CheckpointManager(directory)
  mngr.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), data=FeedStateSave(feed.state())))
  restored = mngr.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params), data=FeedStateRestore()))
  restored.data  # the dict that was saved

The controller knows the whole feed, so only one process writes the file
(``primary_host``, process 0 by default) and every process can read it. The file
is written under a temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from sidecar._src.core import errors

FILENAME = "feed_state.json"
FORMAT = "sidecar.feed_state"
VERSION = 1


class FeedStateHandler(ocp.CheckpointHandler):
  """Saves and restores a feed's state dict as ``feed_state.json``."""

  def __init__(self, *, primary_host: int | None = 0):
    """Creates the handler; Orbax does so with the defaults.

    Args:
      primary_host: the one process that writes the file; None: every process does.
    """
    self._primary_host = primary_host

  def save(self, directory: epath.Path, args: FeedStateSave) -> None:
    text = _dumps(args.state)
    if not ocp.multihost.is_primary_host(self._primary_host):
      return
    directory = epath.Path(directory)
    tmp = directory / f"{FILENAME}.tmp-{uuid.uuid4().hex}"
    tmp.write_text(text)
    tmp.rename(directory / FILENAME)

  def restore(self, directory: epath.Path, args: FeedStateRestore | None = None
              ) -> dict[str, Any]:
    path = epath.Path(directory) / FILENAME
    if not path.exists():
      raise FileNotFoundError(
          f"no feed state at {path}: this checkpoint was saved without a FeedStateSave "
          "item; restore the feed from a step that has one, or start it afresh")
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
      raise ValueError(f"{path} is not a feed state written by FeedStateHandler")
    if saved.get("version") != VERSION:
      raise ValueError(f"{path} has feed state version {saved.get('version')!r}; this "
                       f"colocated-sidecar reads version {VERSION}: upgrade it to restore")
    return saved["state"]

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


def _dumps(state: Any) -> str:
  if not isinstance(state, Mapping):
    raise errors.InvalidArgumentError(
        f"FeedStateSave needs the dict from feed.state(), got {type(state).__name__}")
  try:
    return json.dumps({"format": FORMAT, "version": VERSION, "state": dict(state)},
                      sort_keys=True, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise errors.InvalidArgumentError(
        f"feed state must be JSON-serialisable (str keys; str, int, float, bool, None, "
        f"lists and dicts of them), got {state!r}: {e}") from e


@ocp.args.register_with_handler(FeedStateHandler, for_save=True)
@dataclasses.dataclass
class FeedStateSave(ocp.args.CheckpointArgs):
  """Saves ``state``, the dict returned by ``feed.state()``."""
  state: Mapping[str, Any]


@ocp.args.register_with_handler(FeedStateHandler, for_restore=True)
@dataclasses.dataclass
class FeedStateRestore(ocp.args.CheckpointArgs):
  """Restores the saved state dict.

  Attributes:
    state: unused, and None by default so that Orbax can build these arguments
      itself; kept for symmetry with ``grain.checkpoint.CheckpointRestore``.
  """
  state: Mapping[str, Any] | None = None
