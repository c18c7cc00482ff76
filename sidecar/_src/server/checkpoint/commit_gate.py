"""A step's commit on storage and its abort, one at a time: :class:`CommitGate`.

A step (``step.Step``) holds one. ``save.StepWriter`` commits the step through it (a
trainer's Commit, or the sidecars' ``commit_agreed``: ``begin``, the format's commit,
``end``) and aborts it through it (the trainers' Abort: ``abort``). An abort that meets a
commit under way waits for its end, so it never removes files under the commit's renames
(a committed step with files missing, or a rename that fails with a raw OSError); once the
commit put the step on storage, the abort removes nothing of it and is told where it is.
An abort that comes first refuses every commit after it, by name: a step its trainers
abandoned is never committed.

Threads: the gRPC handlers (Commit, Abort) and the committer's thread; its lock is a
leaf, and an abort waits on an event, outside it.
"""

from __future__ import annotations

import logging
import threading

from sidecar._src.core import errors

log = logging.getLogger(__name__)


class CommitGate:
  """The commit of step ``step`` (its item ``final_dir``) and its abort, one at a time."""

  def __init__(self, step: int, final_dir: str):
    self._step, self._final_dir = step, final_dir
    self._lock = threading.Lock()
    self._ended = threading.Event()  # set while no commit runs (changed under the lock)
    self._ended.set()
    self._aborted = False  # its trainers aborted it: no commit of it begins any more
    self._committed_to = ""  # where its commit put it on storage, once one did

  @property
  def under_way(self) -> bool:
    """Whether a commit of it runs now (between :meth:`begin` and :meth:`end`)."""
    return not self._ended.is_set()

  def begin(self) -> None:
    """Before the commit writes or renames anything: it begins (an abort waits for its
    end from now on; :meth:`end` ends it).

    Raises:
      PermissionDeniedError: a commit of it is under way, or put it on storage already.
      ClosedError: its trainers aborted it (:meth:`abort`): it is not committed.
    """
    with self._lock:
      if not self._ended.is_set() or self._committed_to:
        raise errors.PermissionDeniedError(
            f"commit: step {self._step} at {self._final_dir!r:.200} is being committed "
            f"already{f' or was, at {self._committed_to!r:.200}' if self._committed_to else ''}"
            "; a save is committed once")
      if self._aborted:
        raise errors.ClosedError(
            f"commit: the save of step {self._step} at {self._final_dir!r:.200} was aborted "
            "by its trainers before its commit began: it is not committed (a restore takes "
            "the last committed step); save the step again")
      self._ended.clear()

  def end(self, committed: str = "") -> None:
    """The end of the commit :meth:`begin` began: ``committed``, where it put the step on
    storage (it is committed there); "": it did not (it failed, or committed an item that
    its Orbax CheckpointManager commits)."""
    with self._lock:
      self._committed_to = committed
      self._ended.set()

  def abort(self, timeout: float) -> str:
    """No commit of it begins from now on, and one under way is waited for, at most
    ``timeout`` s. Returns where a commit put it on storage, if one did: it is committed
    then, and the abort must remove nothing of it; "" if none did.

    Raises:
      DeadlineExceededError: its commit still runs after ``timeout`` s.
    """
    with self._lock:
      self._aborted = True
    if not self._ended.is_set():
      log.info("abort: step %d waits for its commit under way to end", self._step,
               extra={"step": self._step})
    if not self._ended.wait(timeout):
      raise errors.DeadlineExceededError(
          f"abort: step {self._step} at {self._final_dir!r:.200} is still being committed "
          f"after {timeout:g} s; abort it again once its commit ended (it then says whether "
          "the step was committed)")
    return self._committed_to
