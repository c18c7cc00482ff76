"""Whether a trainer works: the CPU time its processes burn, as the kernel counts it.

A trainer that makes no step is either **slow** (its threads work: an evaluation nobody
declared, a recompile, a restore) or **hung** (blocked in a call, a deadlock, a peer that
is gone): the first burns CPU, the second burns nothing. Whoever decides reads it from
``/proc`` (``core/procfs.py``: ``utime + stime``, every thread's, each process of the
trainer's process group, its data loader's workers included) and compares two readings
(:class:`Samples`): at least :data:`BUSY_SHARE` of one core over the last
:data:`MIN_WINDOW_S` .. :data:`WINDOW_S` seconds is busy. An idle trainer burned 0-1% on the
2-core development machine (with six runnable threads per core beside it), one waiting
in a collective for another process (gloo) 0.5%, and 0.4-1.5% on the lent v5e; an
evaluation or a recompile of the LM example 18-250% there, as loaded as it was: a busy
thread gets its share of a core however loaded the machine. The time a thread
waits for a CPU (``schedstat``) is no sign of work: an idle thread that wakes now and then
waits as long on a loaded machine (a collective's waiting rank read 5% with it).
``sidecar launch`` reads the process groups of the trainers it started
(``tools/watchdog.py``); nobody's claim enters. ``sidecar stalls`` (a Kubernetes liveness
probe) reads what the sidecar read of each trainer's verified process
(``TrainerStatus.cpu_s``), twice.

What it cannot see, measured on the lent v5e (gVisor, JAX 0.10.2, docs/elastic.md): a process
blocked on one 8 s computation on the chip burned 0.9-1.7% of a core, one asleep in
``time.sleep`` 0.4-1.5%: the device's work is not readable from outside the process that
owns it, and a trainer waiting on its device, on a slow disk (``D`` state) or in a
collective that blocks looks as idle as a hung one. So a long computation with no host
work, a long read, and anything a trainer waits for in another process must be declared
(``ctl.phase``, ``Worker.phase``); an evaluation loop that reads its losses on the host
burned 31% there. A collective that spins (a busy-polling transport) looks busy: such a
hang is found only at the slow bound (``core/stall.py``'s :data:`SLOW_MULTIPLE`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Iterable

from sidecar._src.core import procfs

BUSY_SHARE = 0.05  # of one core: a trainer that burns this much works
MIN_WINDOW_S = 0.5  # the shortest span two readings may be compared over
WINDOW_S = 3.0  # the longest span judged; readings older are dropped (one is kept)


class Samples:
  """Readings of CPU seconds by key (a process group, a trainer), and their rates.

  Args:
    monotonic: the clock of the readings.
  """

  def __init__(self, monotonic: Callable[[], float] = time.monotonic):
    self._monotonic = monotonic
    self._by_key: dict[Hashable, collections.deque[tuple[float, float]]] = {}
    self._offset: dict[Hashable, float] = {}  # what readings lost (a member, a thread ended)

  def add(self, key: Hashable, cpu_s: float | None, at: float | None = None) -> None:
    """``key`` had used ``cpu_s`` seconds of CPU at ``at`` (default now); None: it could
    not be read (its readings are dropped: a rate needs two of the same process)."""
    now = self._monotonic() if at is None else at
    if cpu_s is None:
      self._by_key.pop(key, None)
      self._offset.pop(key, None)
      return
    kept = self._by_key.setdefault(key, collections.deque())
    value = cpu_s + self._offset.get(key, 0.0)
    if kept and value < kept[-1][1]:  # a member ended, its time with it: go on from here
      self._offset[key] = self._offset.get(key, 0.0) + kept[-1][1] - value
      value = kept[-1][1]
    kept.append((now, value))
    while len(kept) > 1 and now - kept[1][0] > WINDOW_S:  # one older than it is kept
      kept.popleft()

  def keep_only(self, keys: Iterable[Hashable]) -> None:
    """Forgets every key but ``keys`` (trainers that ended)."""
    keep = set(keys)
    for key in [k for k in self._by_key if k not in keep]:
      del self._by_key[key]
      self._offset.pop(key, None)

  def rate(self, key: Hashable, *, since: float | None = None) -> float | None:
    """Cores ``key`` burned between its newest reading and its oldest within
    :data:`WINDOW_S` and not before ``since`` (its last step, on the same clock: what it
    did since, not the steps it made before it stopped), at least :data:`MIN_WINDOW_S`
    apart; None: no such two. A trainer that works in bursts (an evaluation that reads
    between its batches) is judged over seconds, not over one pause."""
    kept = self._by_key.get(key)
    if not kept:
      return None
    t1, c1 = kept[-1]
    for t0, c0 in kept:
      if t1 - t0 < MIN_WINDOW_S:
        return None
      if t1 - t0 <= WINDOW_S and (since is None or t0 >= since):
        return (c1 - c0) / (t1 - t0)
    return None

  def busy(self, key: Hashable, *, since: float | None = None) -> bool | None:
    """Whether ``key`` works (:func:`rate` at least :data:`BUSY_SHARE`); None: not known."""
    rate = self.rate(key, since=since)
    return None if rate is None else rate >= BUSY_SHARE


def groups_cpu(groups: Iterable[int]) -> dict[int, float | None]:
  """CPU seconds the live processes of each process group used so far (one read of
  ``/proc``); None for a group with no live process."""
  found = procfs.in_groups(groups)
  return {g: (sum(s.cpu_s for s in members) if members else None)
          for g, members in found.items()}
