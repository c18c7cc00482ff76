"""Each trainer's step progress, as this sidecar sees it: the stall signal.

The sidecar sees every step of the trainers attached to it: a feed's credits (the
trainer took batches: ``credits.SocketCredits``), the goodput ledger's events (a first
step, a save, a mark whose batch count grew: ``workers.py``) and the trainer's own word
(``phase`` frames: its first step completed, a long phase begins or ends). :class:`Steps`
keeps, per worker session, when it attached, its last step and the longest gap between
two steps, and says whether it is **stalled** (the rule: ``core/stall.py``; its floor is
``sidecar serve --stall-timeout``, which ``sidecar launch --stall-timeout`` sets).

Its clock starts at the trainer's first *completed* step, which only the trainer can
tell: a feed's first credits come before the first step's compile (the trainer took
batch 1, then compiles; a device-prefetch thread takes several). So the step signals
before the trainer's ``startup`` phase ends are counted and heard, never timed; a
trainer that never says so (a Worker used alone) is never stalled.

Where its clock runs, what it did between steps goes to the goodput ledger as it was
(``on_gap``: issue 77): a long phase it announced, from its start to its end, and a gap
without a step longer than its stall timeout that ended in a step, ``slow`` (it worked,
or waited for a trainer that did: a hung one is killed, and its time is ``stall``).

``sidecar launch`` polls it in ``Status.trainers`` (``tools/watchdog.py``), the k8s
trainer container's liveness probe and ``sidecar slurm``'s jobs the same way
(``sidecar stalls``), and ``/metrics`` carries each trainer's seconds since its last
step. A session that ends while stalled writes its death to the goodput ledger with its
last step (``stall``, ``core/accounting.py``). Ended sessions stay listed for
:data:`KEEP_ENDED_S` (at most :data:`MAX_ENDED`), so a launcher that sees a trainer exit
can still tell whether it made a step.

What is listed crosses to the launcher as :class:`Trainer`; session names never do (they
are capabilities). A trainer's pid is the one the kernel gave when its connection was
accepted (``workers.py``), with that process's start: it is listed only while that very
process lives (``core/procfs.same``), 0 where the kernel gave none or the process is gone.
A session outlives its process where another holds its connection (a child, a descriptor
passed on); the pid the kernel then gives the next process is never this session's
(issue 76, attack 5). Only a nonzero pid is verified, and only one may be signalled.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from sidecar._src.core import procfs, stall

KEEP_ENDED_S = 60.0
MAX_ENDED = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Trainer:
  """One worker session's progress, as ``Status.trainers`` lists it."""
  pid: int  # the kernel's at attach (the worker socket's peer) while it lives, else 0
  rank: int  # its SIDECAR_PROCESS_ID (-1: not given)
  restart: int  # its SIDECAR_RESTART (-1: not given)
  tenant: str | None
  steps: int  # batches its trainer took from this sidecar's feeds (credited)
  since_step_s: float | None  # seconds since its last step (None: its clock has not started)
  slowest_s: float  # the longest gap between two steps after the first
  timeout_s: float  # its stall timeout now, its phase's budget included (0: off)
  stalled: bool
  ended: bool  # its session ended (listed a while after, see the module docstring)
  phase: str | None = None  # the long phase it announced, while it lasts
  phase_s: float = 0.0  # seconds since that phase began (0: none)
  last_step_unix: float | None = None  # when its last step was (None: its clock waits)
  cpu_s: float | None = None  # CPU seconds its process used (None: its pid is not listed)


@dataclasses.dataclass
class _Track:
  pid: int
  rank: int
  restart: int
  tenant: str | None
  attached: float
  pid_start: int | None = None  # its process's start (clock ticks after boot): who pid is
  seen: float | None = None  # last heard from (a frame, a feed credit)
  steps: int = 0
  batches: int = 0  # the most its ledger's marks counted
  saves: int = 0  # its ledger's saves
  first_save: float | None = None  # monotonic, its first save's, while its clock waits
  last: float | None = None  # monotonic, of the last step once its clock started
  last_wall: float | None = None  # the same, Unix seconds (the ledger's)
  slowest: float = 0.0
  ended: float | None = None  # monotonic
  phase: stall.Phase | None = None  # the long phase it is in
  phase_since: float | None = None  # monotonic, when that phase began (its length, Status)
  phase_began: float = 0.0  # when it began (Unix seconds: the ledger's span)

  def limit(self, floor_s: float) -> float:
    """Its stall timeout now: the rule's, or its phase's budget where larger."""
    limit = stall.timeout(floor_s, self.slowest)
    if limit and self.phase is not None and self.phase.budget_s is not None:
      return max(limit, self.phase.budget_s)
    return limit

  def touch(self, now: float, wall: float) -> None:
    """Its clock runs from now, no step timed (its start ended, a phase began or ended)."""
    self.last, self.last_wall, self.seen = now, wall, wall


@dataclasses.dataclass(frozen=True, slots=True)
class Ended:
  """What a session that ended leaves to its ledger: last heard from, and, where it was
  stalled, its last step and when the stall was declared (Unix seconds)."""
  seen: float | None
  stalled: float | None


# on_gap(session, kind, name, begin, end): "phase" (its name) or "slow" (None), Unix seconds.
OnGap = Callable[[str, str, "str | None", float, float], None]


class Steps:
  """The step progress of this sidecar's worker sessions; thread-safe.

  Args:
    floor_s: the stall timeout's floor (0: no session is ever stalled).
    clock: Unix seconds; ``monotonic``: gaps and ages.
    on_gap: told of each phase that ended and each slow gap (the goodput ledger's
      ``Ledgers.gap``), outside the lock.
  """

  def __init__(self, floor_s: float = stall.DEFAULT_FLOOR_S, *,
               clock: Callable[[], float] = time.time,
               monotonic: Callable[[], float] = time.monotonic, on_gap: OnGap | None = None):
    self.floor_s = stall.check_floor(floor_s)
    self._clock, self._monotonic = clock, monotonic
    self._on_gap = on_gap
    self._lock = threading.Lock()
    self._live: dict[str, _Track] = {}
    self._ended: collections.deque[_Track] = collections.deque(maxlen=MAX_ENDED)

  def attach(self, session: str, *, pid: int, pid_start: int | None = None, rank: int = -1,
             restart: int = -1, tenant: str | None = None) -> None:
    """``session`` attached from process ``pid``, which started at ``pid_start``
    (``core/procfs.py``; None: unknown, so its pid is never listed)."""
    with self._lock:
      self._live[session] = _Track(pid, rank, restart, tenant, self._clock(), pid_start)

  def attached(self, session: str) -> float | None:
    """When ``session`` attached (Unix seconds); None: no such session."""
    with self._lock:
      track = self._live.get(session)
      return None if track is None else track.attached

  def of_start(self, restart: int, tenant: str | None = None, *, every: bool = True
               ) -> list[tuple[str, float]]:
    """The live sessions of start ``restart`` (their ``SIDECAR_RESTART``), with when each
    attached (Unix seconds): all of them (``every``), or ``tenant``'s only."""
    with self._lock:
      return [(s, t.attached) for s, t in self._live.items()
              if t.restart == restart and (every or t.tenant == tenant)]

  def heard(self, session: str) -> None:
    """``session``'s worker said something (a frame, a feed credit)."""
    now = self._clock()
    with self._lock:
      if (track := self._live.get(session)) is not None:
        track.seen = now

  def step(self, session: str, *, taken: int = 0, batches: int | None = None,
           saves: int = 0) -> None:
    """``session``'s trainer made step progress: took ``taken`` batches of a feed (a
    credit), or its ledger says so: ``saves`` saves returned, ``batches`` batches taken
    in all (a step only where it grew). Timed only once its clock started: at the end of
    its startup (:meth:`phase`), or at its second save (a trainer with no feed of ours:
    the gap from its first save is then its slowest step, so a save interval above the
    floor is never a stall)."""
    now, wall = self._monotonic(), self._clock()
    gap = None
    with self._lock:
      track = self._live.get(session)
      if track is None:
        return
      if batches is not None:
        if batches <= track.batches:
          return
        track.batches = batches
      track.steps += max(taken, 0)
      track.saves += max(saves, 0)
      track.seen = wall
      if track.last is None and saves > 0 and track.first_save is None:
        track.first_save = now
      if track.last is None and track.saves >= 2:  # a first save may precede its compile
        track.touch(now, wall)  # and the gap from it is a step: its saves are its steps
        track.slowest = max(track.slowest, now - (track.first_save or now))
      elif track.last is not None:  # its clock runs
        limit = track.limit(self.floor_s)
        if track.phase is None and limit and now - track.last > limit and (
            track.last_wall is not None):
          # Past its timeout, then a step: slow work (the watchdog left it to work), not a
          # step: it never raises the timeout, or the next hang would be found that late.
          gap = ("slow", None, track.last_wall, wall)
        else:
          track.slowest = max(track.slowest, now - track.last)
        track.last, track.last_wall = now, wall
    self._tell(session, gap)

  def _tell(self, session: str, gap: tuple[str, str | None, float, float] | None) -> None:
    if gap is not None and self._on_gap is not None:
      self._on_gap(session, *gap)

  def phase(self, session: str, phase: stall.Phase) -> None:
    """``session``'s trainer said ``phase`` begins or ends (``core/stall.py``): the end of
    :data:`stall.STARTUP` starts its clock; a long phase's start and end restart it,
    and its budget holds while it lasts."""
    now, wall = self._monotonic(), self._clock()
    gap = None
    with self._lock:
      track = self._live.get(session)
      if track is None:
        return
      if phase.name == stall.STARTUP:
        if track.last is None:
          track.touch(now, wall)
        return
      if phase.ends and (track.phase is None or track.phase.name != phase.name):
        return  # not the phase it is in: nothing ends
      if track.phase is not None and track.last is not None:  # it ends (or another begins)
        gap = ("phase", track.phase.name, track.phase_began, wall)
      track.phase = None if phase.ends else phase
      track.phase_since = None if phase.ends else now
      track.phase_began = wall
      if track.last is not None:
        track.touch(now, wall)
      else:
        track.seen = wall
    self._tell(session, gap)

  def end(self, session: str) -> Ended | None:
    """``session`` ended: what its ledger's death needs (None: no such session)."""
    now = self._monotonic()
    with self._lock:
      track = self._live.pop(session, None)
      if track is None:
        return None
      track.ended = now
      self._ended.append(track)
      limit = track.limit(self.floor_s)
      if track.last is None or track.last_wall is None or not limit or (
          now - track.last <= limit):
        return Ended(track.seen, None)
      return Ended(track.last_wall + limit, track.last_wall)

  def trainers(self, tenant: str | None = None, *, every: bool = True) -> list[Trainer]:
    """The sessions attached, and those ended in the last :data:`KEEP_ENDED_S`: all of
    them (``every``), or ``tenant``'s only."""
    now = self._monotonic()
    with self._lock:
      while self._ended and now - (self._ended[0].ended or now) > KEEP_ENDED_S:
        self._ended.popleft()
      tracks = [*self._live.values(), *self._ended]
    return [_listed(t, now, self.floor_s) for t in tracks if every or t.tenant == tenant]


def _listed(t: _Track, now: float, floor_s: float) -> Trainer:
  since = None if t.last is None else (t.ended or now) - t.last
  limit = t.limit(floor_s)
  stat = procfs.read(t.pid) if t.pid and t.pid_start is not None else None
  if stat is None or not stat.alive or stat.start != t.pid_start:
    stat = None  # its process is gone (or never known): no pid of its own any more
  return Trainer(pid=0 if stat is None else t.pid, cpu_s=None if stat is None else stat.cpu_s,
                 rank=t.rank, restart=t.restart, tenant=t.tenant, steps=t.steps,
                 since_step_s=since, slowest_s=t.slowest, timeout_s=limit,
                 stalled=bool(limit) and since is not None and since > limit,
                 ended=t.ended is not None,
                 phase=None if t.phase is None else t.phase.name,
                 phase_s=0.0 if t.phase_since is None else (t.ended or now) - t.phase_since,
                 last_step_unix=t.last_wall)
