"""The threads that finish a process's saves, kept from save to save: :data:`FINISHERS`.

The key-value driver's save (``plugs.SaveRunner``) returns once its shards are copied into
the arenas; one finisher then drives the step's ``save_run.SaveRun`` to its end (begin,
stage the lots, finish, end), on a thread of :data:`FINISHERS`, the process's one pool of
them. A fork's child starts with none (``os.register_at_fork``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable


class Finishing:
  """One save's finisher, run by a thread of :data:`FINISHERS`: joined as a thread is
  (``is_alive``, ``join``), done once its save ended."""

  __slots__ = ("done", "thread")

  def __init__(self) -> None:
    self.done = threading.Event()
    self.thread: threading.Thread | None = None  # the one running it, once it runs

  def is_alive(self) -> bool:
    return not self.done.is_set()

  def join(self, timeout: float | None = None) -> None:
    self.done.wait(timeout)

  def on_this_thread(self) -> bool:
    """Whether the calling thread runs it (a save's end that closes its checkpointer)."""
    return self.thread is threading.current_thread() and self.is_alive()


class Finishers:
  """The process's finisher threads, kept from save to save: each runs one save's finisher
  at a time (:meth:`submit`), as many at once as saves are still finishing (a save's
  end, the deletion of the steps it drops, overlaps the next save). A thread idle for
  :attr:`idle_s` ends; one made anew only where none is idle.

  A thread started for each save cost the trainer's ``save()`` its ``Thread.start``,
  which waits for the new thread to run: 0.2-0.3 ms of a 4 MiB save's 4-5 ms on this
  2-core machine (issue 69: ``benchmarks/save_return``). Each thread is named after
  the save it runs (``sidecar-save-STEP``), ``sidecar-finisher`` while idle."""

  IDLE_NAME = "sidecar-finisher"

  def __init__(self, idle_s: float = 30.0) -> None:
    self.idle_s = idle_s
    self._jobs: queue.SimpleQueue[tuple[Callable[[], None], str, Finishing]] = (
        queue.SimpleQueue())
    self._lock = threading.Lock()
    self._idle = 0  # threads waiting for a job that no job submitted is promised to yet

  def forked(self) -> None:
    """In a child process just forked: none of the parent's threads is there."""
    self._jobs, self._lock, self._idle = queue.SimpleQueue(), threading.Lock(), 0

  def submit(self, finish: Callable[[], None], *, name: str) -> Finishing:
    """Runs ``finish()`` on a finisher thread (an idle one, else a new one); returns it
    (:class:`Finishing`), done once ``finish`` returned or raised."""
    job = Finishing()
    with self._lock:
      new = self._idle == 0
      if not new:
        self._idle -= 1  # that one takes this job: none ends meanwhile
    if new:
      threading.Thread(target=self._run, name=self.IDLE_NAME, daemon=True).start()
    self._jobs.put((finish, name, job))
    return job

  def _run(self) -> None:
    me = threading.current_thread()
    while True:
      try:
        finish, name, job = self._jobs.get(timeout=self.idle_s)
      except queue.Empty:
        with self._lock:
          if self._idle > 0:  # no job is promised to the idle ones: one of them ends
            self._idle -= 1
            return
        continue  # a job is on its way to an idle thread: this one
      job.thread, me.name = me, name
      try:
        finish()
      except BaseException:  # as an uncaught error of a thread of its own: said
        threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), me)))
      finally:
        me.name = self.IDLE_NAME
        with self._lock:
          self._idle += 1
        job.done.set()
        del finish, job  # its save's blocks go with it, not with the next wait


FINISHERS = Finishers()
os.register_at_fork(after_in_child=lambda: FINISHERS.forked())
