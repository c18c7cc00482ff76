"""A checkpointer's saves that failed in the background: :class:`SaveFailures`.

The rule (docs/concepts.md, "A save that fails"): a failed save costs that save, not the
run.

- It is said at once: the checkpointer logs a warning as its ``durable`` fails (a full
  disk, an I/O error, a host lost), naming the step, the cause, the latest committed step
  and the rule; the sidecar that could not write logs its own.
- The next ``save()`` goes on. The first save after it that commits says so (which steps
  failed, which is now the latest committed), and the failure is settled: nothing raises
  it later.
- ``max_failed_saves`` failed saves in a row (:class:`CheckpointOptions`; default 3) end
  the run: the ``save()`` after the last of them raises the first one's error, the others
  in its notes, and saves nothing. With ``max_failed_saves=1`` every failure is raised by
  the next ``save()``, as Orbax's async manager does.
- ``wait()``, ``close()`` and the ``with`` block's end raise a failure no later commit
  settled and no call raised yet (``wait()`` after a save that failed raises it), once.
- One whose error its handle told (``durable.result()`` raised it, ``durable.exception()``
  returned it) is not raised again, but counts in the row.

A save begun on hosts lost since (``Checkpointer._follow``) is told as a warning instead,
never raised nor counted: the loss was handled (the retry's new attempt saves on the hosts
left).
"""

from __future__ import annotations

import errno as errno_lib
import functools
import logging
import threading
from collections.abc import Callable, Sequence

from sidecar._src.controller.checkpoint.save_run import SaveHandle
from sidecar._src.core import errors

log = logging.getLogger(__name__)


class SaveFailures:
  """The failed saves of one checkpointer (of ``directory``) not settled yet.

  Args:
    directory: the checkpoint directory, as errors and warnings name it.
    in_a_row: how many failed saves in a row end the run (``max_failed_saves``).
    latest: the latest committed step now (None: none).
  """

  def __init__(self, directory: str, *, in_a_row: int, latest: Callable[[], int | None]):
    self._directory, self._in_a_row, self._latest = directory, in_a_row, latest
    self._lock = threading.Lock()
    # The saves begun whose outcome is not looked at yet, in the order they began; and
    # those begun on hosts lost since, whose failure is told as a warning.
    self._pending: list[SaveHandle] = []
    self._orphans: list[tuple[SaveHandle, list[int]]] = []
    # The saves that failed since the last one that committed, in order.
    self._row: list[SaveHandle] = []

  def begun(self, handle: SaveHandle) -> None:
    """``handle``'s save is begun: its failure, if any, is said at once and settled."""
    with self._lock:
      self._pending.append(handle)
    handle.durable.add_done_callback(functools.partial(self._ended, handle))

  def not_begun(self, handle: SaveHandle) -> None:
    """``handle``'s save raised as it began: told there, not to be raised again, nor
    counted in the row. Its ``durable`` may have failed already, and its callback moved it
    from the saves pending to the row (a save refused at once, an arena full)."""
    with self._lock:
      self._pending = [h for h in self._pending if h is not handle]
      self._row = [h for h in self._row if h is not handle]

  def lost(self, gone: list[int]) -> None:
    """Hosts ``gone`` were lost: the saves begun before (and those failed in the row) are
    told as warnings from now on, never raised nor counted."""
    with self._lock:
      self._orphans += [(h, gone) for h in [*self._row, *self._pending]]
      self._pending, self._row = [], []

  def lost_with(self, handle: SaveHandle) -> list[int] | None:
    """The hosts whose loss cut ``handle``'s save short; None: none did."""
    with self._lock:
      return next((g for h, g in self._orphans if h is handle), None)

  def _ended(self, handle: SaveHandle, _: object = None) -> None:
    """``handle``'s save ended (its ``durable``'s callback, on the save's thread): a
    failure is said at once; the row is brought up to date."""
    with self._lock:
      self._look()
    error = handle.durable.error()
    if error is None or isinstance(error, errors.HostLostError) or (
        self.lost_with(handle) is not None):
      return  # a host lost is said where its loss is found, and handled there
    if isinstance(error, (KeyboardInterrupt, SystemExit)):  # met the save on its way out:
      return  # the process stops, and says so itself; training does not "go on"
    last = self._latest()
    log.warning(
        "the save of step %d into %s failed in the background: %s: %s. Training goes on: the "
        "next save that commits continues the run (the latest committed step is %s); %d "
        "failed saves in a row end it (CheckpointOptions(max_failed_saves=%d))",
        handle.step, self._directory, type(error).__name__, _first_line(error),
        last if last is not None else "none", self._in_a_row, self._in_a_row,
        extra={"step": handle.step})

  def _look(self) -> None:
    """Under the lock: the saves that ended, in the order they began (up to the first
    still running): a failure joins the row, a commit ends it, saying which steps had
    failed and which is the latest now."""
    while self._pending and self._pending[0].durable.done():
      h = self._pending.pop(0)
      if h.durable.error() is not None:
        self._row.append(h)
      elif self._row:
        many = "s" if len(self._row) > 1 else ""
        log.warning("step %d is committed in %s and the run goes on from it, after the failed "
                    "save%s of step%s %s. The latest committed step is %s", h.step,
                    self._directory, many, many,
                    ", ".join(f"{f.step} ({_cause(f)})" for f in self._row), self._latest(),
                    extra={"step": h.step})
        self._row = []

  def settle(self, *, hosts: Sequence[int]) -> None:
    """Brings the row up to date with the saves that ended (:meth:`_look`); the failures
    of saves begun before a loss are logged here instead (``hosts``: the live hosts the
    checkpointer saves on now)."""
    with self._lock:
      self._look()
      orphans = [(h, gone) for h, gone in self._orphans if h.durable.done()]
      self._orphans = [(h, gone) for h, gone in self._orphans if not h.durable.done()]
    for h, gone in orphans:
      if (e := h.durable.untold()) is not None:
        self._warn_orphan(h.step, gone, e, self._latest(), hosts)

  def too_many(self, where: str, *, step: int) -> BaseException | None:
    """Where the saves that failed in a row reached ``max_failed_saves``: the error that
    ``where`` (a save of ``step``) raises, the row's first (the others in its notes), and
    the row starts anew; else None."""
    with self._lock:
      if len(self._row) < self._in_a_row:
        return None
      row, self._row = self._row, []
    error = self._error(row, where)
    error.add_note(
        f"{len(row)} saves in a row failed (max_failed_saves={self._in_a_row}): the run "
        f"ends here; {where} saved nothing (step {step} not saved)")
    return error

  def unsettled(self, where: str, *, hosts: Sequence[int]) -> BaseException | None:
    """The first failed save of the row that no call raised and no handle told (the others
    in its notes), told to nobody again; None: none. ``where``: the call that raises it.
    The row is brought up to date first, and the failures of saves begun before a loss are
    logged instead (:meth:`settle`; ``hosts``: the live hosts the checkpointer saves on)."""
    self.settle(hosts=hosts)
    with self._lock:
      untold = [h for h in self._row if h.durable.untold() is not None]
      for h in untold:
        h.durable.told = True
    return self._error(untold, where) if untold else None

  def note_on(self, exc: BaseException, where: str, *, hosts: Sequence[int]) -> None:
    """Says the failure :meth:`unsettled` would raise beside ``exc``, the error the
    checkpointer's ``with`` block raised, which goes on: logged, and in ``exc``'s notes."""
    failure = self.unsettled(where, hosts=hosts)
    if failure is not None:
      log.error("%s: %s", type(failure).__name__, failure)
      exc.add_note(f"also, a save failed: {type(failure).__name__}: {failure}"
                   + "".join(f"; {n}" for n in getattr(failure, "__notes__", ())))

  def _error(self, row: list[SaveHandle], where: str) -> BaseException:
    """``row[0]``'s error, noted with its step, ``where`` raises it, the latest committed
    step, and the later failures of ``row``."""
    first = row[0]
    error = first.durable.error()
    assert error is not None
    for h in row:
      h.durable.told = True  # raised now: never again
    last = self._latest()
    host = getattr(error, "host_id", None)
    error.add_note(
        f"the save of step {first.step} into {self._directory} failed in the background"
        + (f" (host {host})" if isinstance(host, int) else "")
        + f"; raised by {where}. The latest committed step is "
        + f"{last if last is not None else 'none'}")
    for h in row[1:]:
      e = h.durable.error()
      error.add_note(f"the save of step {h.step} failed too: {type(e).__name__}: {e}")
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


def _first_line(error: BaseException) -> str:
  return (str(error).splitlines() or [""])[0][:500]


def _cause(handle: SaveHandle) -> str:
  """A failed save's cause in a few words: its error's kind (and errno's name)."""
  error = handle.durable.error()
  code = getattr(error, "errno", None)
  name = errno_lib.errorcode.get(code, "") if isinstance(code, int) else ""
  return type(error).__name__ + (f" {name}" if name else "")
