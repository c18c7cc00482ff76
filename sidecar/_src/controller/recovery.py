"""In-process recovery: a step that raised rolls back to the newest step saved (durable or
not), in the same process, from the save's copies still on the devices or the sidecars'
RAM tier; a step that fails again is left to a restart.

An exception in a training step (a transient runtime error, a NaN guard, a data error)
need not cost a new process (its teardown, the runtime's init, the compile: 13-16 s on
a TPU host). The state it needs is in the sidecars' RAM tier, and the feed can be moved
back to that step's data position. :class:`Recovery` does both, keeping what the process
holds (its compiled functions, its feed's layout, its connections). Nothing in it is
JAX's: ``sidecar.jax.Recovery`` is this class, and ``sidecar.torch.Recovery``
(``torch/recovery.py``) the same with the data position a PyTorch state dict keeps::

  recovery = sidecar.jax.Recovery(ckpt, feed, target=abstract_state)
  while step < steps:
    try:
      state, loss = train_step(state, next(feed))
      step += 1
      ...
    except Exception as e:
      state = None                      # its device memory is free for the restored state
      step, state = recovery.recover(e, step=step + 1)

The rule: each step may fail ``retries_per_step`` times in one process (default once) and
be recovered; its next failure is raised as it came (with a note saying why), so the
process exits and its launcher restarts it (``sidecar launch --max-restarts``). A failure
that comes back at the same step after a rollback is not transient: a new process may
clear it (a runtime in a bad state), and where it does not, the launcher's rule for
failures that recur ends the job.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import traceback
from typing import Any, Protocol

from sidecar._src.controller.checkpoint.checkpointer import Checkpointer
from sidecar._src.controller.checkpoint.rollback import restore_taken_over
from sidecar._src.core import errors, interrupts

log = logging.getLogger(__name__)


class Seekable(Protocol):
  """A feed that can be moved to a saved position (``controller/feed.Feed`` is one).

  A complete one, over a list of batches whose position is an index::

    class Batches:
      def __init__(self, batches):
        self.batches, self.position = batches, 0

      def __next__(self):
        self.position += 1
        return self.batches[self.position - 1]

      def state(self):
        return {"position": self.position}

      def seek(self, state):
        self.position = 0 if state is None else state["position"]
  """

  def seek(self, state: dict[str, Any] | None) -> None:
    """The next batch is the one after ``state`` (a ``state()`` of this feed)."""
    ...


@dataclasses.dataclass(frozen=True, slots=True)
class Rollback:
  """One recovery: the step that failed, the step rolled back to, what it took.

  ``seconds`` runs from :meth:`Recovery.recover`'s call to its return: ``staged_s`` for
  the save in flight to be staged (its copy off the devices into the arenas, and its
  Stages: a step taken over is restored from those bytes; 0 where it was restored from
  the save's copies on the devices, tier ``"device"``, before it was staged), or
  ``waited_s`` for it to be durable (only where the sidecars had not taken it over),
  then the feed's seek and the restore (``restore_s``, from ``tier``:
  ``RestoreStats.tier``). ``durable``: whether ``step`` was durable when restored
  (False: its save was still under way).
  """
  failed_step: int
  error: str  # the exception's type and the first line of its message
  step: int
  tier: str
  restore_s: float
  waited_s: float
  seconds: float
  durable: bool = True
  staged_s: float = 0.0

  def summary(self) -> str:
    waited = f", {self.waited_s:.3f} s waiting for the save in flight" if self.waited_s else ""
    taken = "" if self.durable else (
        ", not staged yet, from the save's copies on the devices" if self.tier == "device"
        else f", taken over and not durable yet, {self.staged_s:.3f} s waiting for its copy")
    return (f"step {self.failed_step} raised {self.error}; rolled back in-process to step "
            f"{self.step} ({self.tier} tier{taken}, restored in {self.restore_s:.3f} s"
            f"{waited}) in {self.seconds:.3f} s")


class Recovery:
  """Rolls a training loop back to the newest step the sidecars hold when a step raises.

  ``recover(error, step=n)``: called where step ``n`` raised ``error``. Where a save is
  in flight and not staged yet (its copy off the devices under way), restores it from
  the copies it still holds on the devices, without waiting for them to land (the
  arrays made are the trainer's own: a step that donates them leaves the save's copy
  whole); where the sidecars took it over (every process's part staged: they commit it
  whatever happens to the trainers), from their RAM tier at once. Either way its copy
  and write go on (if they fail, the next ``save``, ``wait`` or ``close`` raises it, as
  any failed save's), and ``feed`` moves to its data position. Otherwise (its
  trainers commit it: DCP's), waits for it to be durable (a save that fails is logged,
  and the step before it restored), moves ``feed`` to the data position saved with the
  latest committed step and restores that step onto ``target`` (from the sidecars' RAM
  tier where they hold it, else a replica, else storage). Returns ``(step, state)``:
  train on from there. Every process of a job must recover together (an error all of them see,
  such as a NaN guard on a replicated loss): a failure in one process alone should end
  the process, so that the launcher restarts the job.

  Args:
    checkpointer: the loop's checkpointer (``ctl.checkpointer``).
    feed: the loop's feed (``ctl.feed``); anything with ``seek(state)``.
    target: what ``checkpointer.restore`` restores onto (say the abstract state, with
      the same shardings as the loop's state: the compiled step is reused).
    retries_per_step: how often one step that failed is recovered in this process; its
      next failure is raised.

  Raises (from ``recover``):
    The step's own error, where the step failed more than ``retries_per_step`` times,
    or where no step is committed yet to roll back to (a note on it says which), or
    where it is a StopIteration (the feed's end, which no rollback is for). An
    error of the recovery itself (a restore that fails) is raised as it is, the step's
    error its context.
  """

  # What its notes call it: the public name of the class the user made.
  public_name = "sidecar.jax.Recovery"

  def __init__(self, checkpointer: Checkpointer, feed: Seekable, *, target: Any,
               retries_per_step: int = 1):
    if not isinstance(retries_per_step, int) or isinstance(retries_per_step, bool) or (
        retries_per_step < 0):
      raise errors.InvalidArgumentError(
          f"retries_per_step must be an int >= 0, got {retries_per_step!r}")
    self._checkpointer, self._feed, self._target = checkpointer, feed, target
    self.retries_per_step = retries_per_step
    self._failures: collections.Counter[int] = collections.Counter()
    self.rollbacks: list[Rollback] = []  # every recovery of this process, in order

  def recover(self, error: BaseException, *, step: int) -> tuple[int, Any]:
    """Rolls back after step ``step`` raised ``error``; returns ``(step, state)`` of the
    newest committed step, the feed moved to its data position. See the class."""
    t0 = time.perf_counter()
    if isinstance(error, StopIteration):  # the feed's end, no failure: the loop ends
      raise error
    self._failures[step] += 1
    if self._failures[step] > self.retries_per_step:
      error.add_note(
          f"{self.public_name}: step {step} failed {self._failures[step]} times in this "
          f"process (retries_per_step={self.retries_per_step}): not recovered in-process; "
          "the process ends for its launcher to restart it (sidecar launch --max-restarts)")
      raise error
    rolled = restore_taken_over(self._checkpointer, self._target)
    if rolled is not None:  # the save in flight, where its bytes are: no wait for its write
      self._feed.seek(rolled.data_state)
      return self._done(error, step, rolled.step, rolled.tree, waited=0.0, durable=False,
                        t0=t0, staged=rolled.staged_s)
    waited = self._settle()
    latest = self._checkpointer.latest_step()
    if latest is None:
      error.add_note(
          f"{self.public_name}: step {step} failed before any step was committed in "
          f"{self._checkpointer.directory}: there is nothing to roll back to in-process; "
          "the process ends for its launcher to restart it")
      raise error
    state = self._restore(latest)
    return self._done(error, step, latest, state, waited=waited, durable=True, t0=t0)

  def _restore(self, step: int) -> Any:
    """Committed step ``step`` onto the target, the feed moved to its data position (the
    checkpointer's ``data_state``); returns the state."""
    # The feed first: its sidecars make the first batch while the state is restored.
    self._feed.seek(self._checkpointer.data_state(step))
    return self._checkpointer.restore(step, self._target, progress=False)

  def _done(self, error: BaseException, step: int, latest: int, state: Any, *,
            waited: float, durable: bool, t0: float, staged: float = 0.0
            ) -> tuple[int, Any]:
    """Records and logs the rollback from ``step`` to ``latest``; returns ``(latest, state)``."""
    stats = self._checkpointer.last_restore_stats()
    rollback = Rollback(
        failed_step=step, error=_describe(error), step=latest,
        tier=stats.tier if stats is not None else "unknown",
        restore_s=stats.seconds if stats is not None else 0.0, waited_s=waited,
        seconds=time.perf_counter() - t0, durable=durable, staged_s=staged)
    self.rollbacks.append(rollback)
    # What failed, with its traceback as text: a log entry holding the exception would keep
    # the failed step's frames (its batch, its arrays over the arena) as long as a handler
    # keeps the entry.
    log.warning("%s\n%s", rollback.summary(),
                "".join(traceback.format_exception(error)).rstrip())
    return latest, state

  def _settle(self) -> float:
    """Waits for the checkpointer's save in flight to be durable or to fail; the seconds."""
    handle = self._checkpointer.save_in_flight()
    if handle is None:
      return 0.0
    t0 = time.perf_counter()
    interrupts.wait_done(handle.durable)
    error = handle.durable.error()  # logged here, not told: ckpt.wait() or save() raises it
    if error is not None:
      log.warning("the save of step %d in flight when the step failed did not commit (%s): "
                  "rolling back to the step before it", handle.step, _describe(error))
    return time.perf_counter() - t0


def _describe(error: BaseException) -> str:
  lines = str(error).splitlines()
  return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
