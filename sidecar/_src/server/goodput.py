"""The sidecar's side of the goodput ledger: :class:`Ledgers`, one per sidecar.

A trainer's Controller (process 0's) sends ``{"op": "goodput", ...}`` frames on its
worker session (``controller/goodput.py``): the first names the checkpoint directory its
first checkpointer opened, and the sidecar derives the file from it
(``<directory>/goodput.jsonl``, ``core/goodput.FILE``), after the same checks as every
checkpoint path (under a checkpoint root; with per-client tokens or a pool, in a
directory the worker's tenant opened). Every event is checked (``core/goodput.Event``),
at most :data:`MAX_EVENTS` a frame, and appended to the file, flushed to storage: the
ledger outlives the trainer and the sidecar. When a bound session ends without a
``finish`` event (the process died: a signal, an exception, an exit that skipped
``Controller.close()``), the sidecar appends ``died`` at that moment.

The ledger last bound on this sidecar is the job's: ``/metrics`` reads its figures
(:meth:`Ledgers.figures`). Only what accounting needs is kept in memory (a life's
marks replace each other).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.core import errors, goodput as goodput_lib

log = logging.getLogger(__name__)

MAX_EVENTS = 256  # events one frame may carry
MAX_KEPT = 100_000  # events of the job's ledger kept in memory for /metrics


class _Book:
  """One session's binding: the directory and its open file."""

  def __init__(self, directory: str, fd: int):
    self.directory = directory
    self.fd = fd
    self.life: str | None = None
    self.finished = False


class Ledgers:
  """The ledgers the worker sessions of this sidecar write.

  Args:
    resolve: ``resolve(directory, tenant)`` -> the directory resolved, if ``tenant`` may
      write there (raises as the checkpoint calls do).
    clock: Unix seconds (a died event's time).
  """

  def __init__(self, resolve: Callable[[str, str | None], str], *,
               clock: Callable[[], float] = time.time):
    self._resolve = resolve
    self._clock = clock
    self._lock = threading.Lock()
    self._books: dict[str, _Book] = {}  # by worker session
    self._job: str | None = None  # the directory last bound: the job's
    self._events: list[goodput_lib.Event] = []  # the job's, as accounting needs them
    self._closed = False

  def record(self, session: str, message: dict[str, Any], *, tenant: str | None) -> None:
    """Takes one ``goodput`` frame of worker ``session``.

    Raises:
      InvalidArgumentError: a malformed frame (an event, too many, a second directory,
        events before any directory).
      PermissionDeniedError: a directory outside the roots, or another tenant's.
      OSError: the file cannot be written.
    """
    try:
      events = goodput_lib.check_events(message.get("events", []), limit=MAX_EVENTS)
    except ValueError as e:
      raise errors.InvalidArgumentError(f"goodput: {e}") from None
    directory = message.get("directory")
    with self._lock:
      book = self._books.get(session)
      if directory is not None:
        if book is not None:
          raise errors.InvalidArgumentError(
              f"goodput: this session's ledger is bound to {book.directory!r:.200} already")
        book = self._bind(session, directory, tenant)
      if book is None:
        raise errors.InvalidArgumentError(
            "goodput: no ledger is bound to this session; the first message names the "
            "checkpoint directory")
      for event in events:
        if book.life is None:
          book.life = event.life
        elif event.life != book.life:
          raise errors.InvalidArgumentError(
              f"goodput: one session records one process life ({book.life!r:.80}), got an "
              f"event of {event.life!r:.80}")
        book.finished = book.finished or event.kind == "finish"
      self._append(book, events)

  def _bind(self, session: str, directory: Any, tenant: str | None) -> _Book:
    """Opens the ledger of ``directory`` for ``session``; the lock is held."""
    if not isinstance(directory, str):
      raise errors.InvalidArgumentError(
          f"goodput: directory must be a path, got {directory!r:.100}")
    resolved = self._resolve(directory, tenant)
    path = goodput_lib.path_in(resolved)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    book = self._books[session] = _Book(resolved, fd)
    if resolved != self._job:  # the job's ledger now: what came before, from the file
      self._job = resolved
      try:
        self._events = []
        self._keep(goodput_lib.read(resolved))
      except OSError as e:
        log.warning("goodput: cannot read the ledger %s (%s)", path, e)
    log.info("goodput: worker session %s records to %s", session, path,
             extra={"session": session})
    return book

  def _append(self, book: _Book, events: list[goodput_lib.Event]) -> None:
    """Writes ``events`` to ``book``'s file, flushed; the lock is held."""
    if not events:
      return
    data = b"".join(e.line() for e in events)
    view = memoryview(data)
    while view:
      view = view[os.write(book.fd, view):]
    os.fsync(book.fd)
    if book.directory == self._job:
      self._keep(events)

  def _keep(self, events: list[goodput_lib.Event]) -> None:
    """Adds ``events`` to the job's, a life's mark replacing its mark before."""
    for e in events:
      last = self._events[-1] if self._events else None
      if last is not None and e.kind == last.kind == "mark" and e.life == last.life:
        self._events[-1] = e
      else:
        self._events.append(e)
    del self._events[:-MAX_KEPT]

  def ended(self, session: str, seen: float | None = None) -> None:
    """Worker ``session`` ended: a bound one that did not finish died now, last heard
    from at ``seen`` (Unix seconds; None: not known)."""
    with self._lock:
      book = self._books.pop(session, None)
      if book is None:
        return
      try:
        if not book.finished and book.life is not None and not self._closed:
          now = self._clock()
          died = goodput_lib.Event("died", book.life, now,
                                   seen=None if seen is None else min(seen, now))
          self._append(book, [died])
          log.info("goodput: process life %s died (its session ended without a finish)",
                   book.life, extra={"session": session})
      except OSError as e:
        log.warning("goodput: cannot write to the ledger in %s (%s)", book.directory, e)
      finally:
        os.close(book.fd)

  def figures(self) -> tuple[str, goodput_lib.Ledger] | None:
    """The job's ledger (the directory last bound here) and its accounting, or None."""
    with self._lock:
      if self._job is None:
        return None
      events, job = list(self._events), self._job
    return job, goodput_lib.account(events)

  def close(self) -> None:
    """The sidecar stops: sessions that end from now on did not die (their trainer is
    told the sidecar is gone); open files are closed as their sessions end. Idempotent."""
    with self._lock:
      self._closed = True
