"""A pool's jobs over time: a tenant whose job has left gets its RAM-tier steps released.

A tenant with ``ram_keep`` in the pool file (seconds) keeps the RAM-tier copies of the
steps it saved for that long after its job left (so a restarted job restores from memory),
then they go back to the arena for others; its durable steps stay. A tenant's job counts
as gone while it has no worker attached, no feed running and no handshake session used:
``Departures`` asks about once a second (a thread it owns; ``close()`` joins it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

log = logging.getLogger(__name__)

# How often a tenant's presence is looked at.
TICK_S = 1.0


class Departures:
  """Releases the RAM-tier steps of tenants whose job left their ``ram_keep`` ago.

  Args:
    tenancy: the pool in force (reloads included).
    busy: whether tenant ``name`` has a worker attached or a feed running now.
    last_used: when (``time.monotonic()``) a handshake session of tenant ``name`` was last
      used; None if it has none.
    release: drops the RAM-tier steps of tenant ``name``; returns how many.
  """

  def __init__(self, tenancy: tenants_lib.Tenancy, *, busy: Callable[[str], bool],
               last_used: Callable[[str], float | None], release: Callable[[str], int],
               tick_s: float = TICK_S, clock: Callable[[], float] = time.monotonic):
    self._tenancy, self._busy, self._last_used, self._release = tenancy, busy, last_used, release
    self._tick_s, self._clock = tick_s, clock
    self._seen: dict[str, float] = {}  # tenant -> when it was last seen present
    self._released: set[str] = set()  # tenants released since they were last seen
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def start(self) -> Departures:
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="sidecar-departures", daemon=True)
      self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stop.wait(self._tick_s):
      try:
        self.tick()
      except Exception:  # never let one bad tick end the sweeps; said, then retried
        log.exception("releasing departed tenants' RAM-tier steps failed")

  def tick(self) -> list[str]:
    """One look at every tenant with ``ram_keep``; returns those released now."""
    pool = self._tenancy.pool
    now = self._clock()
    released = []
    for t in (pool.tenants if pool is not None else ()):
      keep = quotas_lib.RAM_KEEP.of(t)
      if keep is None:
        continue
      used = self._last_used(t.name)
      seen = max(self._seen.get(t.name, now), used if used is not None else -float("inf"))
      if self._busy(t.name):
        seen = now
      if seen > self._seen.get(t.name, -float("inf")):
        self._released.discard(t.name)  # back: a later departure counts again
      self._seen[t.name] = seen
      if t.name not in self._released and now - seen >= keep:
        self._released.add(t.name)
        n = self._release(t.name)
        released.append(t.name)
        if n:
          log.info("tenant %r left %.0f s ago (ram_keep=%gs): its %d RAM-tier steps are "
                   "released; its durable steps stay", t.name, now - seen, keep, n)
    return released

  def close(self, timeout: float = 5.0) -> None:
    """Stops the sweeps and joins the thread; idempotent."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None
