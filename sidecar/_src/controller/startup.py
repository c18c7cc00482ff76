"""A trainer process's startup, as its sidecars' stall rule needs it: when it ends.

The sidecar times a trainer from its first *completed* step (``core/stall.py``), which only
the trainer can tell: its feed's first batch is taken before the first step's ``jit``
compile, and a device-prefetch thread takes several more. :class:`Startup` counts the
batches the trainer's own thread takes (``Feed.__next__``'s return) and, at the second
(step 1 is done), tells each sidecar this process maps that :data:`stall.STARTUP` ended
(``Worker.tell``): one frame per sidecar, once per Controller. A long phase later
(``Controller.phase``) is told the same way; one that lasts until the next completed step
(:meth:`Startup.until_step`: an elastic attempt's restore and recompile) ends at the second
batch taken after it began, as the startup does, or at the second save returned after it
began (:meth:`Startup.saved`): a trainer that takes no batch from our feeds (its own
loader) has its saves as its only steps, which its sidecar sees (the goodput ledger's save
events: ``server/goodput/steps.py``), the first of which may precede a recompile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from sidecar._src.core import errors, stall

log = logging.getLogger(__name__)


class Told(Protocol):
  """What a phase is told to: a Worker (``arena/worker.py``)."""

  def tell(self, phase: stall.Phase) -> bool: ...


class Startup:
  """Ends this process's startup at its second batch taken; then :meth:`batch` only adds.

  Args:
    workers: the Workers this process maps now (each one's sidecar is told).
    then: called with each batch's ``(blocked_s, now)`` after (the goodput ledger's).
  """

  def __init__(self, workers: Callable[[], Iterable[Told]],
               then: Callable[[float, float], None] | None = None):
    self._workers, self._then = workers, then
    self.batches = self.saves = 0
    # Phases until a step: name -> the batch count and the save count they end at.
    self._ends: dict[str, tuple[int, int]] = {}

  def batch(self, blocked_s: float, now: float) -> None:
    """A batch was taken in the trainer's thread (``Feed``'s ``on_batch``)."""
    self.batches += 1
    if self.batches == 2:
      tell(self._workers(), stall.Phase(stall.STARTUP))
    self._end_stepped()
    if self._then is not None:
      self._then(blocked_s, now)

  def saved(self) -> None:
    """A ``save()`` returned that saved (not skipped), in the trainer's thread."""
    self.saves += 1
    self._end_stepped()

  def _end_stepped(self) -> None:
    """Ends the phases until a step whose step came (their second batch or save)."""
    for name in [n for n, (batches, saves) in self._ends.items()
                 if self.batches >= batches or self.saves >= saves]:
      if self._ends.pop(name, None) is not None:  # once, where a save's thread races
        tell(self._workers(), stall.Phase(name))

  @contextlib.contextmanager
  def phase(self, name: str, budget_s: float, *, until_step: bool = False
            ) -> Iterator[None]:
    """Phase ``name`` with ``budget_s`` seconds without a step (``Controller.phase``),
    told to the workers; with ``until_step``, :meth:`until_step`."""
    if until_step:
      with self.until_step(name, budget_s):
        yield
      return
    tell(self._workers(), _checked(name, budget_s))
    try:
      yield
    finally:
      tell(self._workers(), stall.Phase(name))

  @contextlib.contextmanager
  def until_step(self, name: str, budget_s: float) -> Iterator[None]:
    """Phase ``name`` with ``budget_s`` seconds without a step, until the next completed
    step (the second batch the trainer's thread takes from now, the first being taken
    before a recompile; or the second save returned from now, for a trainer with no feed
    of ours) or the block's end, whichever comes first. Entered and left in the trainer's
    thread, as :meth:`batch` and :meth:`saved` are called."""
    begins = _checked(name, budget_s)
    tell(self._workers(), begins)
    self._ends[name] = (self.batches + 2, self.saves + 2)
    try:
      yield
    finally:
      if self._ends.pop(name, None) is not None:  # no step yet: ends here
        tell(self._workers(), stall.Phase(name))


def tell(workers: Iterable[Told], phase: stall.Phase) -> None:
  """Tells each of ``workers`` ``phase``; one that cannot be told is logged (the stall
  rule then does not know: never worth failing a step for)."""
  for w in workers:
    try:
      told = w.tell(phase)
    except Exception as e:  # noqa: BLE001 - a lost sidecar is the health watch's to say
      told, why = False, f"{type(e).__name__}: {e}"
    else:
      why = "its socket was busy for a second, or its sidecar is gone"
    if not told:
      log.log(logging.DEBUG if phase.name == stall.CLOSE else logging.WARNING,
              "the stall rule of %r was not told that phase %r %s (%s)", w, phase.name,
              "ends" if phase.ends else f"begins (budget {phase.budget_s:g} s)", why)


def _checked(name: str, budget_s: float) -> stall.Phase:
  """Phase ``name`` begins with ``budget_s``; InvalidArgumentError as the rule refuses it."""
  try:
    return stall.Phase(name, budget_s)
  except ValueError as e:
    raise errors.InvalidArgumentError(str(e)) from None
