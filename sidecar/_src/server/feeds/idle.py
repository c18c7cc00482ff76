"""Feed worker processes kept idle after their stream ended, for the next stream of the same work.

A feed's worker processes (``processes.FeedProcesses``) take seconds to start: each is a
fresh interpreter that imports the pipeline's modules (JAX, Grain) and builds the pipeline.
A trainer rolled back in its process (``Feed.seek``) or restarted beside the same sidecar
opens the same feed again; its re-done steps are served the kept batches (``replay.py``),
but the first batch after them would wait for new workers. So a stream that ends (its
consumer closed it, or died) leaves its workers here, idle, for ``grace`` seconds
(:data:`GRACE_S`, ``sidecar serve --feed-idle-s``; 0: stopped at once, as before), under a
:class:`WorkKey`: what makes two streams' workers compute the same batch from the same task.
The next stream of that key adopts them (:meth:`Lease.workers`): its first new batch is made
by warm workers.

- Before they are kept, the ended stream's batches in flight are waited for and dropped
  (``FeedProcesses.drain``): none reaches the next stream, none is written after its blocks
  went back. Where they do not come in time (:data:`DRAIN_S`, or :data:`DRAIN_BATCHES` of the
  workers' slowest batch: a batch stuck in the pipeline), the workers are stopped.
- A stream that finds none idle waits for those of its key being drained, and for
  :data:`HANDOVER_S` at most for those its own worker session still uses (``Feed.seek``
  closed that stream just before; the sidecar sees it end a moment later).
- Nothing is adopted across another key. The adopter rebinds them to its own consumer
  (``alive``), its tenant's turns and its own worker count (``FeedProcesses.adopt``).
- Idle workers count against their tenant's ``feed_workers`` quota, and a feed of the tenant
  that needs the room has them stopped first (:meth:`IdleWorkers.feeding`); at most
  :data:`MAX_IDLE` processes stay idle in all (the oldest go first).
- They are stopped at the grace's end (the store's thread), at the sidecar's stop, and at a
  reload that revokes their tenant; a sidecar that dies (``kill -9``) closes their sockets,
  and they exit (``child.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

from sidecar._src.core import errors, options as options_lib
from sidecar._src.server.feeds import kept as kept_lib, processes as processes_lib, producer
from sidecar._src.server.pool import shares as shares_lib
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.user import data_roots

log = logging.getLogger(__name__)

# How long a stream's workers stay idle for the next stream of their work (the sidecar's
# ``feed_idle_s``, ``sidecar serve --feed-idle-s``).
GRACE_S = options_lib.FEED_IDLE_S
# An ended stream's batches in flight are waited for this long at least, or this many times
# the slowest batch its workers made if longer; past it its workers are stopped, not kept.
DRAIN_S = 1.0
DRAIN_BATCHES = 3
# How long a stream that finds no idle workers of its key waits for those its worker
# session still uses in a stream of the same key (a rollback closed it a moment before).
HANDOVER_S = 2.0
# Idle worker processes in all, at most: past it the oldest go.
MAX_IDLE = producer.MAX_WORKERS
# How often a stream waiting for workers asks whether its consumer still lives.
WAIT_EVERY = 0.1


@dataclasses.dataclass(frozen=True, slots=True)
class WorkKey:
  """What a feed's workers were made for; another stream adopts them only where all of it
  matches: the kept batches' key (tenant, pipeline and its code, arguments, seed, rows and
  batch, data identity), where the pipeline may read (its tenant's data roots), and the
  arena the workers write into (each maps that memfd)."""
  feed: kept_lib.FeedKey
  roots: str  # the data roots' JSON
  arena: int  # ``arenas.Space.id``: never reused within a sidecar

  @classmethod
  def of(cls, feed: kept_lib.FeedKey, *, roots: data_roots.DataRoots, arena: int) -> WorkKey:
    return cls(feed, json.dumps(roots.to_dict(), sort_keys=True), arena)


@dataclasses.dataclass(eq=False, slots=True)
class _Idle:
  key: WorkKey
  workers: processes_lib.FeedProcesses
  until: float  # monotonic: stopped then
  hold: contextlib.ExitStack | None  # its tenant's count of them; None: a stream waits for them


class IdleWorkers:
  """A sidecar's idle feed worker processes, by :class:`WorkKey` (see the module).

  Args:
    tenancy: whose quotas idle workers count against.
    grace: how long an ended stream's workers stay idle; 0: none stay.
    limit: idle worker processes in all, at most.
  """

  def __init__(self, tenancy: tenants_lib.Tenancy | None = None, *, grace: float = GRACE_S,
               limit: int = MAX_IDLE):
    self.grace, self._limit = grace, limit
    self._tenancy = tenancy or tenants_lib.Tenancy(None)
    self._cond = threading.Condition()
    self._idle: list[_Idle] = []  # oldest first
    self._parking: collections.Counter[WorkKey] = collections.Counter()  # being drained
    self._using: collections.Counter[tuple[WorkKey, str]] = collections.Counter()  # by session
    self._waiting: collections.Counter[WorkKey] = collections.Counter()  # streams waiting
    self._closed = False
    self._reaper: threading.Thread | None = None
    self.adopted = 0  # worker groups a stream adopted, in all (tests, benchmarks)

  def lease(self, key: WorkKey, *, session: str) -> Lease:
    """A stream of ``key`` (of worker session ``session``) opens: idle workers of its key
    are its own from now on (no longer idle, nor counted as such); see :class:`Lease`."""
    with self._cond:
      entry = self._take(key)
    return Lease(self, key, session, None if entry is None else entry.workers)

  @contextlib.contextmanager
  def feeding(self, tenant: str | None, workers: int) -> Iterator[None]:
    """``tenancy.feeding(tenant, workers)`` while the block runs: where the tenant's idle
    workers hold the room its ``feed_workers`` quota leaves, they are stopped first.

    Raises:
      ResourceExhaustedError: the tenant runs as many feeds or feed workers as it may.
    """
    with self._tenancy.feeding(tenant, 0), contextlib.ExitStack() as room:
      try:
        room.enter_context(self._tenancy.feed_workers(tenant, workers))
      except errors.ResourceExhaustedError:
        if tenant is None or not (stopped := self.release(tenant)):
          raise
        log.info("tenant %r's %d idle feed worker processes stopped: a new feed of it needs "
                 "their room in its feed_workers quota", tenant, stopped)
        room.enter_context(self._tenancy.feed_workers(tenant, workers))
      yield

  def release(self, tenant: str) -> int:
    """Stops ``tenant``'s idle workers (a reload revoked it, or a feed of it needs their
    room); how many processes."""
    with self._cond:
      gone = [e for e in self._idle if e.key.feed.tenant == tenant]
      self._idle = [e for e in self._idle if e.key.feed.tenant != tenant]
    return self._stop(gone)

  def pids(self) -> list[int]:
    """The idle worker processes, sorted."""
    with self._cond:
      return sorted(pid for e in self._idle for pid in e.workers.pids)

  def close(self) -> None:
    """Stops every idle worker, and those of streams that end later; idempotent."""
    with self._cond:
      self._closed = True
      gone, self._idle = self._idle, []
      reaper, self._reaper = self._reaper, None
      self._cond.notify_all()
    self._stop(gone)
    if reaper is not None:
      reaper.join()

  # ---- a lease's ---------------------------------------------------------------------

  def _wait_for(self, key: WorkKey, session: str, alive: Callable[[], bool] | None
                ) -> processes_lib.FeedProcesses | None:
    """Idle workers of ``key``, once those being drained (or, for ``HANDOVER_S`` at most,
    in use by ``session``) are left; None where none come.

    Raises:
      ClosedError: the consumer died meanwhile.
    """
    handover = time.monotonic() + HANDOVER_S
    with self._cond:
      self._waiting[key] += 1
    try:
      while True:
        with self._cond:
          if (entry := self._take(key)) is not None:
            return entry.workers
          if self._closed or not (self._parking[key] or (
              session and self._using[key, session] and time.monotonic() < handover)):
            return None
          self._cond.wait(WAIT_EVERY)
        if alive is not None and not alive():
          raise errors.ClosedError("the feed's consumer is gone; its batch is abandoned")
    finally:
      with self._cond:
        self._waiting[key] -= 1
        unheld = []
        if not self._waiting[key]:  # left to a stream that no longer waits: counted, or go
          del self._waiting[key]
          unheld = [e for e in self._idle if e.key == key and e.hold is None]
          unheld = [e for e in unheld if not self._held(e)]
      self._stop(unheld)

  def _count_adopted(self) -> None:
    with self._cond:
      self.adopted += 1

  def _use(self, key: WorkKey, session: str, n: int) -> None:
    with self._cond:
      self._using[key, session] += n
      if not self._using[key, session]:
        del self._using[key, session]
      self._cond.notify_all()

  def _park(self, key: WorkKey, session: str, workers: processes_lib.FeedProcesses) -> None:
    """The stream of ``key`` that used ``workers`` ended: drained, they are kept idle."""
    with self._cond:
      self._using[key, session] -= 1
      if not self._using[key, session]:
        del self._using[key, session]
      self._parking[key] += 1
      keep = self.grace > 0 and not self._closed and not self._revoked(key)
    try:
      if keep:
        keep = workers.drain(max(DRAIN_S, DRAIN_BATCHES * workers.slowest_s))
        if not keep:
          log.info("feed %r: a batch in flight did not end within %.1f s of its stream's "
                   "end (or a worker died); its workers are stopped, not kept idle",
                   key.feed.pipeline, max(DRAIN_S, DRAIN_BATCHES * workers.slowest_s))
    except BaseException:
      keep = False  # stopped, whatever failed
      raise
    finally:
      with self._cond:
        self._parking[key] -= 1
        if not self._parking[key]:
          del self._parking[key]
        self._cond.notify_all()
      if keep:
        self._keep(key, workers)
      else:
        workers.close()

  def _keep(self, key: WorkKey, workers: processes_lib.FeedProcesses) -> None:
    """Keeps ``workers`` (none of their batches in flight) idle for ``grace``: counted
    against their tenant's quota, unless a stream waits for them; stopped where it has no
    room or the store is closed."""
    with self._cond:
      entry = _Idle(key, workers, time.monotonic() + self.grace, None)
      if self._closed or self._revoked(key) or not (self._waiting[key] or self._held(entry)):
        gone = [entry]
      else:
        self._idle.append(entry)
        gone = []
        while sum(len(e.workers.pids) for e in self._idle) > self._limit:
          gone.append(self._idle.pop(0))
        if self._reaper is None:
          self._reaper = threading.Thread(target=self._reap, name="sidecar-feed-idle",
                                          daemon=True)
          self._reaper.start()
      self._cond.notify_all()
    self._stop(gone)

  # ---- the lock is held ------------------------------------------------------------

  def _take(self, key: WorkKey) -> _Idle | None:
    """The newest idle entry of ``key``, no longer idle (nor counted as such)."""
    for i in range(len(self._idle) - 1, -1, -1):
      if self._idle[i].key == key:
        entry = self._idle.pop(i)
        if entry.hold is not None:
          entry.hold.close()
        return entry
    return None

  def _held(self, entry: _Idle) -> bool:
    """Counts ``entry``'s workers against its tenant's quota; False where they do not fit
    (then ``entry`` is no longer idle)."""
    hold = contextlib.ExitStack()
    try:
      hold.enter_context(self._tenancy.feed_workers(entry.key.feed.tenant,
                                                     len(entry.workers.pids)))
    except errors.ResourceExhaustedError:
      if entry in self._idle:
        self._idle.remove(entry)
      return False
    entry.hold = hold
    return True

  def _revoked(self, key: WorkKey) -> bool:
    return key.feed.tenant is not None and key.feed.tenant in self._tenancy.revoked

  # ---- the reaper's ------------------------------------------------------------------

  def _reap(self) -> None:
    """Stops idle workers at their grace's end, until the store closes."""
    while True:
      with self._cond:
        while not self._closed:
          now = time.monotonic()
          gone = [e for e in self._idle if e.until <= now]
          if gone:
            self._idle = [e for e in self._idle if e.until > now]
            break
          first = min((e.until for e in self._idle), default=None)
          self._cond.wait(None if first is None else first - now)
        else:
          return
      for e in gone:
        log.info("feed %r: its %d idle worker processes stopped, %g s after their stream "
                 "ended with none of the same work since", e.key.feed.pipeline,
                 len(e.workers.pids), self.grace)
      self._stop(gone)

  @staticmethod
  def _stop(entries: list[_Idle]) -> int:
    stopped = 0
    for e in entries:
      if e.hold is not None:
        e.hold.close()
        e.hold = None
      stopped += len(e.workers.pids)
      e.workers.close()
    return stopped


class Lease:
  """One feed stream's worker processes: idle ones of its key adopted (those claimed as it
  opened, else those another stream of the key is about to leave), else made anew; kept
  idle again once the stream ends (``IdleWorkers``)."""

  def __init__(self, store: IdleWorkers, key: WorkKey, session: str,
               claimed: processes_lib.FeedProcesses | None):
    self._store, self.key, self._session = store, key, session
    self._claimed = claimed

  @contextlib.contextmanager
  def workers(self, make: Callable[[], processes_lib.FeedProcesses], *, size: int,
              turns: shares_lib.Turns | None, alive: Callable[[], bool] | None
              ) -> Iterator[processes_lib.FeedProcesses]:
    """The stream's ``size`` workers while the block runs: adopted (rebound to ``turns``
    and ``alive``) or ``make()``'s. Where the block ends as a stream does (its end, its
    close, its consumer gone) they are kept idle for the next stream of the key; where it
    raises another error they are stopped."""
    workers, self._claimed = self._claimed, None
    if workers is None:
      workers = self._store._wait_for(self.key, self._session, alive)
    if workers is not None:
      try:
        workers.adopt(size, turns=turns, alive=alive)
      except BaseException:
        workers.close()
        raise
      self._store._count_adopted()
      log.info("feed %r: %d idle worker processes (pids %s) adopted from a stream of the same "
               "work", self.key.feed.pipeline, size, workers.pids)
    else:
      workers = make()
    self._store._use(self.key, self._session, 1)
    try:
      yield workers
    except (GeneratorExit, errors.ClosedError):
      self._store._park(self.key, self._session, workers)
      raise
    except BaseException:
      self._store._use(self.key, self._session, -1)
      workers.close()
      raise
    self._store._park(self.key, self._session, workers)

  def close(self) -> None:
    """The stream ended: workers it claimed and never used are idle again; idempotent."""
    workers, self._claimed = self._claimed, None
    if workers is not None:
      self._store._keep(self.key, workers)
