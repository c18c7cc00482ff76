"""The sidecar's side of the goodput ledger: :class:`Ledgers`, one per sidecar.

A trainer's Controller (process 0's) sends ``{"op": "goodput", ...}`` frames on its
worker session (``controller/goodput.py``): the first names the checkpoint directory its
first checkpointer opened, and the sidecar derives the file from it
(``<directory>/goodput.jsonl``, ``core/goodput.FILE``), after the same checks as every
checkpoint path (under a checkpoint root; with per-client tokens or a pool, in a
directory the worker's tenant opened). When a bound session ends without a ``finish``
event (the process died: a signal, an exception, an exit that skipped
``Controller.close()``), the sidecar appends ``died`` at that moment.

A life dies stalled where its own process was stalled at its end (``steps.py``), or where
``sidecar launch`` (or ``sidecar slurm``'s trainer task) said another trainer of the same
start stalled and was killed (:meth:`Ledgers.stalled`: the Stalled RPC,
``tools/watchdog.py``): process 0 is often not stalled yet when rank k's stall is found,
and rank k's sidecar keeps no book. A report marks the book only; it counts where the life
then dies without a finish and without another step (a first step, a save, more batches
taken), and its stall starts no earlier than the session attached.

What a frame may do is bounded, whoever sends it (docs/goodput.md, "The bound"):

- every event is checked (``core/goodput.Event``), at most :data:`MAX_EVENTS` a frame, and
  its times against this sidecar's clock: none after now + :data:`SKEW_S`, none before
  the session attached (less :data:`SKEW_S`), a process start at most
  :data:`MAX_STARTUP_S` before it, counters no larger than the life's age; a frame that
  fails is refused whole, naming the field;
- marks are coalesced: a session's mark is written at most every :data:`MARK_EVERY_S`,
  the latest one held until then (the counters are cumulative: nothing is lost), and
  with the next other event or the session's end;
- a tenant's appends, all its sessions together, pass one token bucket of
  :data:`BURST_BYTES` and :data:`RATE_BYTES_S` (a session costs nothing to open, so a
  bucket per session bounded nothing: issue 70, item 6), or of a pool tenant's
  ``ledger_burst_bytes`` and ``ledger_bytes_per_s`` (its :class:`Bound`), and, for a pool
  tenant with
  ``checkpoint_bytes``, its storage quota before they are written (the ledger's file is
  in its directory, and counted). What a session's end must write (its held mark, its
  ``died``) goes whatever the bucket holds and is owed: the tenant's next frames wait
  until the bucket is out of debt;
- each append starts on a fresh line: a line torn by a sidecar killed mid-append (or a
  write that failed half way) loses only itself.

``/metrics`` shows one ledger per tenant and directory (:meth:`Ledgers.figures`): a
tenant's frames change only the ledgers it bound, and each tenant keeps at most
:data:`MAX_JOBS` of them in memory (its oldest dropped). Only what accounting needs is
kept (a life's marks replace each other).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar._src.core import accounting, errors, goodput as goodput_lib
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

log = logging.getLogger(__name__)

MAX_EVENTS = 256  # events one frame may carry
MAX_KEPT = 20_000  # events of one ledger kept in memory for /metrics
MAX_JOBS = 4  # ledgers of one tenant kept in memory for /metrics (the latest bound)
SKEW_S = 10.0  # how far a trainer's time stamps may be off this sidecar's clock
MAX_STARTUP_S = 3600.0  # how long before its session attached a process may have started
MARK_EVERY_S = 10.0  # a session's marks are written at most this often
BURST_BYTES = 64 << 10  # a tenant's appends: this many bytes at once,
RATE_BYTES_S = 4 << 10  # and this many a second on average (a pool file's tenant: its own)
_WARN_EVERY_S = 10.0  # a session's refused frames are logged at most this often

Check = Callable[[str | None, str, int], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Figures:
  """One ledger for ``/metrics``: whose, where, and its accounting."""
  tenant: str | None
  directory: str
  ledger: accounting.Ledger


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
  """What one tenant may append to its ledgers, all its sessions together: ``burst``
  bytes at once and ``rate`` a second on average; ``why``: what sets it, for messages
  (a pool file's keys and line, or the sidecar's default)."""
  burst: int = BURST_BYTES
  rate: int = RATE_BYTES_S
  why: str = "the sidecar's default"


DEFAULT = Bound()


def bound_of(tenancy: tenants_lib.Tenancy, tenant: str | None) -> Bound:
  """What ``tenant``'s sessions may append to their goodput ledgers: its pool file's
  ``ledger_bytes_per_s`` and ``ledger_burst_bytes``, each else the sidecar's default."""
  t = tenancy.tenant(tenant)
  rate = None if t is None else quotas_lib.LEDGER_BYTES_PER_S.of(t)
  burst = None if t is None else quotas_lib.LEDGER_BURST_BYTES.of(t)
  if t is None or (rate is None and burst is None):
    return DEFAULT
  given = ", ".join(f"{q.key}={q.of(t)}" for q in (
      quotas_lib.LEDGER_BYTES_PER_S, quotas_lib.LEDGER_BURST_BYTES) if q.of(t) is not None)
  return Bound(burst=BURST_BYTES if burst is None else burst,
               rate=RATE_BYTES_S if rate is None else rate,
               why=f"{given}, {tenancy.where(t.name)}")


class _Bucket:
  """One tenant's :class:`Bound` as a token bucket, all its sessions together."""

  def __init__(self, now: float, bound: Bound):
    self.bound = bound
    self.tokens, self.filled = float(bound.burst), now

  def take(self, nbytes: int, now: float, *, force: bool = False) -> bool:
    """Whether ``nbytes`` more may be written now (taken from the bucket if so);
    ``force``: taken whatever it holds (a session's end), owed below zero."""
    self.tokens = min(self.bound.burst, self.tokens + (now - self.filled) * self.bound.rate)
    self.filled = now
    if nbytes > self.tokens and not force:
      return False
    self.tokens -= nbytes
    return True

  def owes(self, now: float) -> bool:
    """Whether it is in debt (a session's end wrote past it): nothing more goes yet."""
    return self.tokens + (now - self.filled) * self.bound.rate < 0


class _Book:
  """One session's binding: the directory, its open file, and its tenant's budget."""

  def __init__(self, directory: str, fd: int, tenant: str | None, bucket: _Bucket, *,
               torn: bool):
    self.directory, self.fd, self.tenant, self.bucket = directory, fd, tenant, bucket
    self.life: str | None = None
    self.start: float | None = None  # the life's process start (its start event)
    self.finished = False
    self.torn = torn  # the file does not end with a newline: the next append adds one
    self.held: goodput_lib.Event | None = None  # the latest mark, not written yet
    self.batches = 0  # the most batches its events counted
    # A stall of another trainer of this start, reported (sidecar launch): its last
    # step and when it was found stalled (Unix seconds); dropped at this life's next step.
    self.reported: tuple[float, float] | None = None
    self.marked = -MARK_EVERY_S  # when a mark was last written
    self.warned = -_WARN_EVERY_S


class Ledgers:
  """The ledgers the worker sessions of this sidecar write.

  Args:
    resolve: ``resolve(directory, tenant)`` -> the directory resolved, if ``tenant`` may
      write there (raises as the checkpoint calls do).
    check_storage: ``check_storage(tenant, directory, nbytes)`` raises
      ResourceExhaustedError where ``nbytes`` more in ``directory`` would pass the
      tenant's storage quota (``Checkpoints.check_storage``); default: no quota.
    bound: ``bound(tenant)`` -> what the tenant may append (a pool file's keys, read at
      each frame: a reload's new values hold at once); default: :data:`DEFAULT`.
    clock: Unix seconds (a died event's time, and the check of a frame's times).
    monotonic: the bucket's and the marks' clock.
  """

  def __init__(self, resolve: Callable[[str, str | None], str], *,
               check_storage: Check | None = None,
               bound: Callable[[str | None], Bound] | None = None,
               clock: Callable[[], float] = time.time,
               monotonic: Callable[[], float] = time.monotonic):
    self._resolve = resolve
    self._bound = bound or (lambda tenant: DEFAULT)
    self._check_storage = check_storage or (lambda tenant, directory, nbytes: None)
    self._clock, self._monotonic = clock, monotonic
    self._lock = threading.Lock()
    self._books: dict[str, _Book] = {}  # by worker session
    self._buckets: dict[str | None, _Bucket] = {}  # by tenant (None: no tenants)
    # Each tenant's ledgers, by directory, the latest bound last: their events as
    # accounting needs them.
    self._jobs: dict[str | None, collections.OrderedDict[str, list[goodput_lib.Event]]] = {}
    self._closed = False

  def receive(self, session: str, message: dict[str, Any], *, tenant: str | None,
              attached: float | None = None) -> None:
    """Takes one ``goodput`` frame of worker ``session``, attached at ``attached`` (Unix
    seconds; None: not known, its times are checked against now only).

    Raises:
      InvalidArgumentError: a malformed frame (an event, too many, a time off this
        sidecar's clock, a second directory, events before any directory).
      PermissionDeniedError: a directory outside the roots, or another tenant's.
      ResourceExhaustedError: the session writes faster than the ledger's bound, or the
        tenant's storage quota would be passed.
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
      elif book is None:
        raise errors.InvalidArgumentError(
            "goodput: no ledger is bound to this session; the first message names the "
            "checkpoint directory")
      self._check_times(events, book, attached)
      bucket = self._bucket(tenant)
      if bucket.owes(self._monotonic()):
        raise self._too_fast(tenant, book.directory if book is not None else directory,
                             bucket.bound)
      if book is None:
        book = self._bind(session, directory, tenant)
      for event in events:
        if book.life is None:
          book.life = event.life
        elif event.life != book.life:
          raise errors.InvalidArgumentError(
              f"goodput: one session records one process life ({book.life!r:.80}), got an "
              f"event of {event.life!r:.80}")
      for event in events:
        book.finished = book.finished or event.kind == "finish"
        stepped = event.kind in ("first_step", "save") or (
            event.counters is not None and event.counters.batches > book.batches)
        if stepped and book.reported is not None:
          book.reported = None  # it stepped since: the stall reported is not its death
        if event.counters is not None:
          book.batches = max(book.batches, event.counters.batches)
        if event.kind == "start" and book.start is None:
          book.start = event.start
      self._append(book, events)

  def _check_times(self, events: list[goodput_lib.Event], book: _Book | None,
                   attached: float | None) -> None:
    """InvalidArgumentError where an event's time is off this sidecar's clock."""
    now = self._clock()
    earliest = None if attached is None else attached - SKEW_S
    start = None if book is None else book.start
    for e in events:
      if e.t > now + SKEW_S or (earliest is not None and e.t < earliest):
        raise errors.InvalidArgumentError(
            f"goodput: an event's time {e.t:.3f} is {_off(e.t, now)} this sidecar's clock "
            f"({now:.3f}), which only times after its worker session attached, up to now, "
            f"pass (within {SKEW_S:g} s); the trainer's clock is off, or the frame is "
            "not the sidecar library's")
      if e.start is not None:
        start = e.start
        if e.start > now + SKEW_S or (earliest is not None
                                      and e.start < earliest - MAX_STARTUP_S):
          raise errors.InvalidArgumentError(
              f"goodput: a process start at {e.start:.3f} is {_off(e.start, now)} this "
              f"sidecar's clock ({now:.3f}): a process's start passes from "
              f"{MAX_STARTUP_S:g} s before its worker session attached up to now")
      if start is not None and e.counters is not None and (
          e.counters.blocked_s > max(e.t, now) - start + SKEW_S):
        raise errors.InvalidArgumentError(
            f"goodput: an event counts {e.counters.blocked_s:.3f} s blocked, more than its "
            f"process has lived ({max(e.t, now) - start:.3f} s)")

  def _bind(self, session: str, directory: Any, tenant: str | None) -> _Book:
    """Opens the ledger of ``directory`` for ``session``; the lock is held."""
    if not isinstance(directory, str):
      raise errors.InvalidArgumentError(
          f"goodput: directory must be a path, got {directory!r:.100}")
    resolved = self._resolve(directory, tenant)
    path = goodput_lib.path_in(resolved)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
      size = os.fstat(fd).st_size
      torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
    except OSError:
      os.close(fd)
      raise
    book = self._books[session] = _Book(resolved, fd, tenant, self._bucket(tenant), torn=torn)
    jobs = self._jobs.setdefault(tenant, collections.OrderedDict())
    if resolved in jobs:
      jobs.move_to_end(resolved)
    else:  # this tenant's ledger now: what came before, from the file
      jobs[resolved] = []
      while len(jobs) > MAX_JOBS:
        jobs.popitem(last=False)
      try:
        _keep(jobs[resolved], goodput_lib.read(resolved))
      except OSError as e:
        log.warning("goodput: cannot read the ledger %s (%s)", path, e)
    log.info("goodput: worker session %s records to %s", session, path,
             extra={"session": session})
    return book

  def _bucket(self, tenant: str | None) -> _Bucket:
    """``tenant``'s bucket, held to its bound in force; the lock is held."""
    bound = self._bound(tenant)
    bucket = self._buckets.get(tenant)
    if bucket is None:
      bucket = self._buckets[tenant] = _Bucket(self._monotonic(), bound)
    elif bucket.bound != bound:  # a reload changed it: what it holds fits the new one
      bucket.take(0, self._monotonic())
      bucket.bound, bucket.tokens = bound, min(bucket.tokens, float(bound.burst))
    return bucket

  def _append(self, book: _Book, events: list[goodput_lib.Event], *,
              force: bool = False) -> None:
    """Writes ``events`` to ``book``'s file, flushed, marks coalesced; the lock is held.
    ``force``: the session ends, its held mark and these go whatever the bucket says."""
    now = self._monotonic()
    out = []
    for e in events:
      if e.kind == "mark":
        book.held = e
      else:
        if book.held is not None:
          out.append(book.held)
          book.held = None
        out.append(e)
    if book.held is not None and (force or now - book.marked >= MARK_EVERY_S):
      out.append(book.held)
      book.held = None
    if not out:
      return
    data = (b"\n" if book.torn else b"") + b"".join(e.line() for e in out)
    if not book.bucket.take(len(data), now, force=force):
      raise self._too_fast(book.tenant, book.directory, book.bucket.bound)
    self._check_storage(book.tenant, book.directory, len(data))
    book.torn = True  # until the write is whole
    view = memoryview(data)
    while view:
      view = view[os.write(book.fd, view):]
    os.fsync(book.fd)
    book.torn = False
    if any(e.kind == "mark" for e in out):
      book.marked = now
    jobs = self._jobs.get(book.tenant)
    job = None if jobs is None else jobs.get(book.directory)
    if job is not None:
      _keep(job, out)

  @staticmethod
  def _too_fast(tenant: str | None, directory: Any, bound: Bound
                ) -> errors.ResourceExhaustedError:
    whose = f"tenant {tenant!r}'s sessions append" if tenant else "this sidecar's sessions append"
    return errors.ResourceExhaustedError(
        f"goodput: {whose} to their ledgers (this one in {directory!r:.200}) faster than "
        f"{bound.rate} bytes/s together (bursts of {bound.burst}; {bound.why}); the sidecar "
        "library writes far less: is this trainer's ledger client its own? (A pool's "
        "operator may raise a tenant's ledger_bytes_per_s and ledger_burst_bytes in the "
        "pool file.)")

  def refused(self, session: str) -> bool:
    """Whether a refusal of ``session``'s frame should be logged now (at most every
    :data:`_WARN_EVERY_S`: a flood of bad frames is not a flood of log lines)."""
    with self._lock:
      book = self._books.get(session)
      if book is None:
        return True
      now = self._monotonic()
      if now - book.warned < _WARN_EVERY_S:
        return False
      book.warned = now
      return True

  def stalled(self, session: str, last_step: float, found: float) -> bool:
    """``sidecar launch`` found another trainer of ``session``'s start stalled at
    ``found``, its last step at ``last_step`` (Unix seconds, this sidecar's clock), and
    killed it: ``session``'s life, if it now dies without another step, died of that
    stall. Returns whether ``session`` keeps a ledger here (process 0's does)."""
    with self._lock:
      book = self._books.get(session)
      if book is None or book.finished or book.life is None:
        return False
      last_step = min(last_step, found)
      if book.reported is not None:  # two reports: the earlier stall, found the later
        last_step, found = min(last_step, book.reported[0]), max(found, book.reported[1])
      book.reported = (last_step, found)
      log.info("goodput: process life %s is reported stalled since %.3f (another trainer "
               "of its start stalled)", book.life, last_step, extra={"session": session})
      return True

  def gap(self, session: str, kind: str, name: str | None, begin: float, end: float
          ) -> None:
    """Worker ``session``'s trainer spent ``begin`` .. ``end`` (Unix seconds) without a
    step, as ``kind``: a ``phase`` it announced (``name``), or ``slow`` (past its stall
    timeout, then a step: ``steps.py``): written to its ledger, if it keeps one here,
    within its tenant's bound (a trainer that flips phases without end is not a flood of
    lines: what passes the bound is dropped, and said at most every few seconds)."""
    with self._lock:
      book = self._books.get(session)
      if book is None or book.finished or book.life is None or self._closed:
        return
      book.reported = None  # it stepped (or ended a phase): a stall reported is not its death
      try:
        event = goodput_lib.Event(kind, book.life, end, begin=min(begin, end), name=name)
        self._append(book, [event])
      except (ValueError, OSError, errors.SidecarError) as e:
        now = self._monotonic()
        if now - book.warned >= _WARN_EVERY_S:
          book.warned = now
          log.warning("goodput: a %s span of %s not written (%s)", kind, book.life, e,
                      extra={"session": session})

  def ended(self, session: str, seen: float | None = None, *,
            stalled: float | None = None) -> None:
    """Worker ``session`` ended: a bound one that did not finish died now, last heard
    from at ``seen`` (Unix seconds; None: not known); ``stalled``: its last step, where
    it died stalled (``server/goodput/steps.py``), or another trainer's, where one of its
    start was reported stalled (:meth:`stalled`)."""
    with self._lock:
      book = self._books.pop(session, None)
      if book is None:
        return
      if book.reported is not None:  # the stall found first (the earliest last step)
        last_step, found = book.reported
        stalled = last_step if stalled is None else min(stalled, last_step)
        seen = found if seen is None else max(seen, found)
      try:
        died = []
        if not book.finished and book.life is not None and not self._closed:
          now = self._clock()
          died = [goodput_lib.Event("died", book.life, now,
                                    seen=None if seen is None else min(seen, now),
                                    stalled=None if stalled is None else min(stalled, now))]
        self._append(book, died, force=True)
        if died:
          log.info("goodput: process life %s died%s (its session ended without a finish)",
                   book.life, " stalled" if stalled is not None else "",
                   extra={"session": session})
      except (OSError, errors.SidecarError) as e:
        log.warning("goodput: cannot write to the ledger in %s (%s)", book.directory, e)
      finally:
        os.close(book.fd)

  def figures(self) -> list[Figures]:
    """Every ledger kept (each tenant's latest bound), accounted, for ``/metrics``."""
    with self._lock:
      jobs = [(tenant, directory, list(events)) for tenant, by_dir in self._jobs.items()
              for directory, events in by_dir.items()]
    return [Figures(tenant, directory, accounting.account(events))
            for tenant, directory, events in jobs]

  def close(self) -> None:
    """The sidecar stops: sessions that end from now on did not die (their trainer is
    told the sidecar is gone); open files are closed as their sessions end. Idempotent."""
    with self._lock:
      self._closed = True


def _off(t: float, now: float) -> str:
  return f"{t - now:.0f} s after" if t > now else f"{now - t:.0f} s before"


def _keep(kept: list[goodput_lib.Event], events: list[goodput_lib.Event] | tuple) -> None:
  """Adds ``events`` to ``kept``, a life's mark replacing its mark before."""
  for e in events:
    last = kept[-1] if kept else None
    if last is not None and e.kind == last.kind == "mark" and e.life == last.life:
      kept[-1] = e
    else:
      kept.append(e)
  del kept[:-MAX_KEPT]
