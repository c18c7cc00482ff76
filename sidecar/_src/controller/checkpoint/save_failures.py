"""A checkpointer's saves that failed in the background, each told once: :class:`SaveFailures`.

As Orbax's async manager does, a save whose ``durable`` failed (a full disk, an I/O error,
a host lost) is raised by the checkpointer's next ``save``, ``wait`` or ``close``, once;
one whose handle told its error already is not raised again. A save begun on hosts lost
since (``Checkpointer._follow``) is told as a warning instead, never raised: the loss was
handled (the retry's new attempt saves on the hosts left).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from sidecar._src.controller.checkpoint.save_run import SaveHandle

log = logging.getLogger(__name__)


class SaveFailures:
  """The saves of one checkpointer (of ``directory``) whose failure is not told yet."""

  def __init__(self, directory: str):
    self._directory = directory
    self._lock = threading.Lock()
    # The saves begun whose failure no save(), wait() or close() has raised yet; and
    # those begun on hosts lost since, whose failure is told as a warning.
    self._unreported: list[SaveHandle] = []
    self._orphans: list[tuple[SaveHandle, list[int]]] = []

  def begun(self, handle: SaveHandle) -> None:
    """``handle``'s save is begun: its failure, if any, is to be told."""
    with self._lock:
      self._unreported.append(handle)

  def not_begun(self, handle: SaveHandle) -> None:
    """``handle``'s save raised as it began: told there, not to be raised again."""
    with self._lock:
      self._unreported.remove(handle)

  def lost(self, gone: list[int]) -> None:
    """Hosts ``gone`` were lost: the saves begun before are told as warnings from now on."""
    with self._lock:
      self._orphans += [(h, gone) for h in self._unreported]
      self._unreported = []

  def lost_with(self, handle: SaveHandle) -> list[int] | None:
    """The hosts whose loss cut ``handle``'s save short; None: none did."""
    with self._lock:
      return next((g for h, g in self._orphans if h is handle), None)

  def take(self, where: str, *, skipped: int | None, latest: Callable[[], int | None],
           hosts: Sequence[int]) -> BaseException | None:
    """The first failed save that no save(), wait() or close() raised yet (later ones named
    in its notes), told to nobody again; None: none. The failures of saves begun before a
    loss are logged here instead. ``where``: the call that raises it; ``skipped``: the
    step it was asked to save; ``latest``: the latest committed step; ``hosts``: the live
    hosts the checkpointer saves on now."""
    with self._lock:
      ended = [h for h in self._unreported if h.durable.done()]
      self._unreported = [h for h in self._unreported if not h.durable.done()]
      orphans = [(h, gone) for h, gone in self._orphans if h.durable.done()]
      self._orphans = [(h, gone) for h, gone in self._orphans if not h.durable.done()]
    for h, gone in orphans:
      if (e := h.durable.untold()) is not None:
        self._warn_orphan(h.step, gone, e, latest(), hosts)
    failed = [(h.step, e) for h in ended if (e := h.durable.untold()) is not None]
    if not failed:
      return None
    (step, error), later = failed[0], failed[1:]
    last = latest()
    host = getattr(error, "host_id", None)
    error.add_note(
        f"the save of step {step} into {self._directory} failed in the background"
        + (f" (host {host})" if isinstance(host, int) else "")
        + f"; raised by {where}"
        + (f", which saved nothing (step {skipped} not saved)" if skipped is not None else "")
        + f". The latest committed step is {last if last is not None else 'none'}")
    for s, e in later:
      error.add_note(f"the save of step {s} failed too: {type(e).__name__}: {e}")
    return error

  def _warn_orphan(self, step: int, gone: list[int], error: BaseException,
                   latest: int | None, hosts: Sequence[int]) -> None:
    """Says that ``step``, begun before hosts ``gone`` were lost, was not saved."""
    log.warning(
        "step %d was not saved into %s: its save, begun before hosts %s were lost, failed "
        "(%s: %s). Not raised: this checkpointer saves on the live hosts %s since; the "
        "latest committed step is %s", step, self._directory, gone, type(error).__name__,
        str(error)[:300], list(hosts), latest if latest is not None else "none",
        extra={"step": step})
