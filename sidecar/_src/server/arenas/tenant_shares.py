"""Each tenant's share of the arenas: its guaranteed arena, its ceiling, its turn.

With a pool file (``tenancy``) a block counts against the tenant that allocated it until it
is freed, whoever holds it then (the RAM tier keeps a save's blocks): a tenant never holds
more than its ``arena_ceiling``, and never takes what other tenants are guaranteed
(``arena``) and do not use yet. A tenant's request that does not fit now waits its turn in
the :class:`admission.Queue` (within its timeout), while durable RAM-tier copies give way
(``reclaim``). :class:`leases.Leases` reserves a tenant's bytes here before it takes a
block for it, and says here when the block is made and when it is freed, under one lock
that both share.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.arenas import arenas as arenas_lib
from sidecar._src.server.pool import admission
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

# How often a request waiting in the admission queue tells its caller where it stands
# (and asks whether it is still there).
ON_WAIT_S = 1.0

Key = tuple[int, int]  # a block: (its arena, its offset)


class Reclaimed:
  """What one wait for room let go of in the RAM tier that has not come back as free
  room yet: a copy's blocks return when its last view goes, not at once, and a wait that
  asked again for the whole shortfall each turn emptied the tier for one request."""

  def __init__(self):
    self.outstanding = 0
    self._free: int | None = None  # the free bytes seen at the last turn

  def short(self, need: int, free: int) -> int:
    """What ``need`` bytes lack beyond what went and has not come back, ``free`` now."""
    if self._free is not None and free > self._free:
      self.outstanding = max(0, self.outstanding - (free - self._free))
    self._free = free
    return need - self.outstanding

  def add(self, freed: int) -> int:
    self.outstanding += freed
    return freed


class TenantShares:
  """What each tenant of ``tenancy``'s pool holds of the arenas (``allocator``: their
  figures together) and may take, under ``lock``, the lock of the blocks' holders
  (``freed``: its condition, notified when a block is let go of).

  ``reclaim(nbytes, tenant)``: where the arena is full, lets go of about ``nbytes`` that
  can give way (the RAM tier's durable copies) and returns how many.
  """

  def __init__(self, allocator: arenas_lib.Arenas, tenancy: tenants_lib.Tenancy | None, *,
               lock: threading.Lock, freed: threading.Condition,
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               reclaim: Callable[[int, str | None], int] | None = None):
    self.allocator = allocator
    self._tenancy = tenancy
    self._lock, self._freed = lock, freed
    self._metrics = metrics
    self._reclaim = reclaim
    self._queue = admission.Queue()
    self._tenant_bytes: collections.Counter[str] = collections.Counter()  # allocated, live
    self._block_tenant: dict[Key, str] = {}  # block -> the tenant that allocated it
    self._pending = 0  # bytes tenants reserved, not allocated yet
    # The pool the shares below were read from, each tenant's (guaranteed, ceiling) in bytes,
    # and the guarantees' sum: read once per pool (a reload swaps the pool), not per block.
    self._shares_read: tuple[object, dict[str, tuple[int, int | None]], int] = (None, {}, 0)

  def allocated(self, t: tenants_lib.Tenant, nbytes: int, key: Key, size: int) -> None:
    """Tenant ``t``'s reservation of ``nbytes`` became block ``key`` of ``size`` bytes;
    the lock is held."""
    self._pending -= nbytes
    self._tenant_bytes[t.name] += size - nbytes
    self._block_tenant[key] = t.name

  def cancel(self, t: tenants_lib.Tenant, nbytes: int) -> None:
    """Tenant ``t``'s reservation of ``nbytes`` made no block: it goes back."""
    with self._lock:
      self._pending -= nbytes
      self._unreserve(t, nbytes)

  def freed(self, key: Key, size: int) -> None:
    """Block ``key`` of ``size`` bytes went back to its arena; the lock is held."""
    self._queue.freed(size)
    self._freed.notify_all()
    tenant = self._block_tenant.pop(key, None)
    if tenant is not None:
      self._tenant_bytes[tenant] -= size
      if self._tenant_bytes[tenant] <= 0:
        del self._tenant_bytes[tenant]
      self._freed.notify_all()

  def spare(self, tenant: str) -> int:
    """The arena bytes ``tenant`` holds beyond its guaranteed arena (0 outside a pool)."""
    t = None if self._tenancy is None else self._tenancy.tenant(tenant)
    if t is None:
      return 0
    with self._lock:
      return max(0, self._tenant_bytes.get(t.name, 0) - self.share(t)[0])

  def share(self, t: tenants_lib.Tenant) -> tuple[int, int | None]:
    """Tenant ``t``'s guaranteed arena and ceiling in bytes."""
    found = self._arena_shares()[0].get(t.name)
    if found is None:  # not of the pool in force (a reload removed it meanwhile)
      size = self.allocator.size
      return (quotas_lib.ARENA.bytes_of(t, size) or 0,
              quotas_lib.ARENA_CEILING.bytes_of(t, size))
    return found

  def open_to(self, t: tenants_lib.Tenant) -> int:
    """The most arena tenant ``t`` could ever hold: all of it but the others' guarantees."""
    shares, total = self._arena_shares()
    return self.allocator.size - total + (shares[t.name][0] if t.name in shares else 0)

  def reserve(self, t: tenants_lib.Tenant, nbytes: int, deadline: float | None,
              alive: Callable[[], bool] | None = None,
              on_wait: Callable[[admission.Place], None] | None = None,
              report_s: float = ON_WAIT_S, *,
              held_by: Callable[[str | None], str] = lambda tenant: "") -> None:
    """Counts ``nbytes`` more against tenant ``t`` once its ceiling and the others'
    guarantees leave room and its turn in the admission queue comes, waiting until
    ``deadline``.

    Raises:
      ResourceExhaustedError: no room in time; naming the tenant, its place and the quota.
    """
    self._metrics.tenant_requested(t.name, "arena", nbytes)
    with self._lock:
      if self._admit(t, nbytes, None):
        return
    reclaimed = Reclaimed()
    self._give_way(t, nbytes, reclaimed)
    with self._lock:
      if self._admit(t, nbytes, None):
        return
      if deadline is not None and deadline <= time.monotonic():
        raise self._queued_error(t, nbytes, None, 0.0, held_by)
      w = self._queue.join(t.name, nbytes)
    told = -float("inf")  # when on_wait was last told (once every report_s)
    with self._metrics.waiting(t.name, "arena"), self._lock:
      try:
        while not self._admit(t, nbytes, w):
          left = None if deadline is None else deadline - time.monotonic()
          if left is not None and left <= 0:
            raise self._queued_error(t, nbytes, w, time.monotonic() - w.since, held_by)
          if alive is not None and not alive():
            raise errors.ClosedError(
                f"tenant {t.name!r}'s request for {shm.format_size(nbytes)} of the arena "
                "left the queue: its caller is gone")
          if on_wait is not None and time.monotonic() - told >= report_s:
            told = time.monotonic()
            place = self._place(t, nbytes, w)
            w.telling = True  # it stands aside meanwhile (admission.Waiter)
            self._lock.release()  # telling a client may block: never under the lock
            try:
              on_wait(place)
            finally:
              self._lock.acquire()
              w.telling = False
          self._lock.release()  # durable RAM-tier copies give way, outside the lock
          try:
            self._give_way(t, nbytes, reclaimed)
          finally:
            self._lock.acquire()
          self._freed.wait(report_s if left is None else min(left, report_s))
      finally:
        self._queue.leave(w)
        self._freed.notify_all()  # the next waiter's turn may have come

  def waiting(self) -> dict[str, int]:
    """The requests of each tenant waiting in the admission queue now."""
    with self._lock:
      return self._queue.counts()

  def tenant_bytes(self) -> dict[str, int]:
    """The arena bytes each tenant allocated and are not freed yet."""
    with self._lock:
      return {n: b for n, b in self._tenant_bytes.items() if b > 0}

  def _arena_shares(self) -> tuple[dict[str, tuple[int, int | None]], int]:
    """Each tenant's guaranteed arena and ceiling in bytes (``quotas.ARENA``,
    ``ARENA_CEILING``), and the guarantees' sum, of the pool in force."""
    pool = None if self._tenancy is None else self._tenancy.pool
    cached, shares, total = self._shares_read
    if cached is not pool:
      size = self.allocator.size
      shares = {o.name: (quotas_lib.ARENA.bytes_of(o, size) or 0,
                        quotas_lib.ARENA_CEILING.bytes_of(o, size))
               for o in (pool.tenants if pool is not None else ())}
      total = sum(g for g, _ in shares.values())
      self._shares_read = (pool, shares, total)
    return shares, total

  def _shares(self, t: tenants_lib.Tenant) -> tuple[int | None, int]:
    """Tenant ``t``'s ceiling (None: none) and what other tenants are guaranteed and do
    not hold yet, in bytes."""
    shares, _ = self._arena_shares()
    reserved = 0
    for name, (guaranteed, _ceiling) in shares.items():
      if name != t.name:
        reserved += max(0, guaranteed - self._tenant_bytes.get(name, 0))
    return self.share(t)[1], reserved

  def _give_way(self, t: tenants_lib.Tenant, nbytes: int, reclaimed: Reclaimed) -> None:
    """Lets durable RAM-tier copies go (``reclaim``) for what tenant ``t`` lacks of
    ``nbytes`` now (within its ceiling, beside the others' guarantees), less what this wait
    let go of already (``reclaimed``). The lock is not held."""
    if self._reclaim is None:
      return
    with self._lock:
      ceiling, reserved = self._shares(t)
      mine = self._tenant_bytes.get(t.name, 0)
      free = self._free()
      short = reclaimed.short(max(nbytes + reserved - free,
                                  0 if ceiling is None else mine + nbytes - ceiling), free)
    if short > 0:
      reclaimed.add(self._reclaim(short, t.name))

  def _free(self) -> int:
    """The arena's bytes neither allocated nor reserved: bytes reserved but not allocated
    yet are as good as used. The lock is held."""
    return self.allocator.size - self.allocator.used_bytes - self._pending

  def _admit(self, t: tenants_lib.Tenant, nbytes: int, w: admission.Waiter | None) -> bool:
    """Takes ``nbytes`` for tenant ``t`` if they fit and its turn has come; the lock is
    held."""
    ceiling, reserved = self._shares(t)
    mine = self._tenant_bytes.get(t.name, 0)
    over_ceiling = ceiling is not None and mine + nbytes > ceiling
    if w is not None:
      w.for_ceiling = over_ceiling
    free = self._free()
    within = mine + nbytes <= self.share(t)[0]
    if over_ceiling or free - nbytes < reserved or not self._queue.may_go(t.name, within, w):
      return False
    self._tenant_bytes[t.name] += nbytes
    self._pending += nbytes
    return True

  def _place(self, t: tenants_lib.Tenant, nbytes: int,
             w: admission.Waiter) -> admission.Place:
    ceiling, reserved = self._shares(t)
    mine = self._tenant_bytes.get(t.name, 0)
    if w.for_ceiling and ceiling is not None:
      short = mine + nbytes - ceiling
    else:
      free = self._free()
      short = nbytes + reserved - free
    return self._queue.place(w, short)

  def _queued_error(self, t: tenants_lib.Tenant, nbytes: int, w: admission.Waiter | None,
                    waited: float, held_by: Callable[[str | None], str]
                    ) -> errors.ResourceExhaustedError:
    ceiling, reserved = self._shares(t)
    mine = self._tenant_bytes.get(t.name, 0)
    over_ceiling = ceiling is not None and mine + nbytes > ceiling
    error = self._past_share(t, nbytes, mine, ceiling, reserved, over_ceiling, held_by)
    if w is None:
      w = self._queue.join(t.name, nbytes)  # where it would have stood
      try:
        place = self._place(t, nbytes, w)
      finally:
        self._queue.leave(w)
    else:
      place = self._place(t, nbytes, w)
    return errors.ResourceExhaustedError(
        f"{error} (it waited {waited:.3g} s, at {place.describe()}; pass a longer "
        "timeout= to wait its turn)")

  def _unreserve(self, t: tenants_lib.Tenant, nbytes: int) -> None:
    self._tenant_bytes[t.name] -= nbytes
    if self._tenant_bytes[t.name] <= 0:
      del self._tenant_bytes[t.name]
    self._freed.notify_all()

  def _past_share(self, t: tenants_lib.Tenant, nbytes: int, mine: int, ceiling: int | None,
                  reserved: int, over_ceiling: bool, held_by: Callable[[str | None], str]
                  ) -> errors.ResourceExhaustedError:
    """Why tenant ``t``'s request for ``nbytes`` is not admitted: past its ceiling, the
    arena full (and what holds it), or the others' guarantees. The lock is held."""
    fmt = shm.format_size
    where = self._tenancy.where(t.name) if self._tenancy is not None else ""
    if over_ceiling:
      return errors.ResourceExhaustedError(
          f"tenant {t.name!r} holds {fmt(mine)} of the arena; {fmt(nbytes)} more would pass "
          f"its quota (arena_ceiling={quotas_lib.ARENA_CEILING.of(t)} = {fmt(ceiling or 0)}, "
          f"{where}); free arrays, feeds' batches or RAM-tier steps sooner, or raise its "
          "arena_ceiling")
    free = self._free()
    if free < nbytes:  # full, whatever the guarantees: say what holds it
      return errors.ResourceExhaustedError(
          f"tenant {t.name!r} holds {fmt(mine)} of the arena; {fmt(nbytes)} more do not fit: "
          f"the arena is full, {fmt(max(free, 0))} free of {fmt(self.allocator.size)}; "
          f"{held_by(t.name)}; free arrays, feeds' batches or RAM-tier "
          "steps sooner, or raise --shm-size")
    return errors.ResourceExhaustedError(
        f"tenant {t.name!r} holds {fmt(mine)} of the arena; {fmt(nbytes)} more would take "
        f"from the guaranteed arena of other tenants ({fmt(reserved)} they are guaranteed and "
        f"do not use yet; its own quota: arena={quotas_lib.ARENA.of(t)}, {where}); free arrays "
        "sooner, or give it a larger guaranteed arena in the pool file")
