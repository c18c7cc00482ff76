"""What a pool's tenants share on one sidecar beyond their quotas, fairly, by weight
(issue 37): the CPUs its feed workers fill batches on (:class:`Shares`), and its storage's
write bandwidth (:class:`Bandwidth`).

A tenant's ``feed_workers`` quota (``tenants.Tenancy.feeding``) bounds the worker processes
it may start, but the host's CPUs are one for everybody: a tenant running 16 workers on 2
cores would take most of them from the others' feeds. So the batches feed workers fill at
once on a sidecar are shared among the tenants that run a feed now, as ``limits.py`` shares
a total among tenants: a tenant's share of ``total`` (the host's CPUs) is
``max(1, int(total * weight / sum of the weights of the tenants with a feed))``. A tenant
alone with work uses all of them; a tenant at its share waits for one of its own batches to
end, never for another tenant's. A feed without workers counts as work too (it fills its
batches on a sidecar thread), so its tenant's presence shrinks a hog's share.

Saves write in turns of at most ``direct_io.TURN_BYTES``; a turn that comes free goes to
the tenant that wrote the least lately, for its weight: a tenant saving one step at a time
gets the storage when it asks, and one saving four at once takes what the others leave.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

# How fast a tenant's past writes fade from its account: what it wrote HALF_LIFE_S ago
# counts half.
HALF_LIFE_S = 1.0
# How long a turn that ends stays kept for its tenant, where that tenant would go next
# anyway: long enough for its thread to ask for the next piece of its file.
ANTICIPATE_S = 0.002


class Shares:
  """The feed worker batches in flight on one sidecar, per tenant; ``total``: its CPUs."""

  def __init__(self, total: int):
    if total < 1:
      raise ValueError(f"total must be at least 1, got {total!r}")
    self.total = total
    self._cond = threading.Condition()
    self._feeds: dict[str, int] = {}  # tenant -> feeds running
    self._weights: dict[str, float] = {}  # tenant -> its weight, while it has a feed
    self._busy: dict[str, int] = {}  # tenant -> batches in its workers now

  def turns(self, tenant: str, weight: float = 1.0) -> Turns:
    """``tenant``'s turns for one feed: it counts as having work while they are entered."""
    return Turns(self, tenant, weight)

  def _enter(self, tenant: str, weight: float) -> None:
    with self._cond:
      self._feeds[tenant] = self._feeds.get(tenant, 0) + 1
      self._weights[tenant] = weight
      self._cond.notify_all()  # the others' shares shrink; none is taken back, they drain

  def _exit(self, tenant: str) -> None:
    with self._cond:
      self._feeds[tenant] -= 1
      if not self._feeds[tenant]:
        del self._feeds[tenant], self._weights[tenant]
      self._cond.notify_all()  # the others' shares grow

  def share(self, tenant: str) -> int:
    """Batches ``tenant``'s workers may fill at once now."""
    with self._cond:
      return self._share(tenant)

  def _share(self, tenant: str) -> int:
    weights = sum(self._weights.values())
    weight = self._weights.get(tenant, 0.0)
    return max(1, int(self.total * weight / weights)) if weights else self.total

  def busy(self, tenant: str) -> int:
    with self._cond:
      return self._busy.get(tenant, 0)

  def _free(self, tenant: str) -> bool:
    with self._cond:
      return self._busy.get(tenant, 0) < self._share(tenant)

  def _take(self, tenant: str) -> None:
    with self._cond:
      self._cond.wait_for(lambda: self._busy.get(tenant, 0) < self._share(tenant))
      self._busy[tenant] = self._busy.get(tenant, 0) + 1

  def _give(self, tenant: str, n: int) -> None:
    with self._cond:
      self._busy[tenant] -= n
      if not self._busy[tenant]:
        del self._busy[tenant]
      self._cond.notify_all()


class Turns:
  """One feed's turns at the sidecar's feed workers, for its tenant; a context manager:
  the tenant has work while it is entered. ``take()`` before a batch goes to a worker,
  ``give()`` when its answer came (or the batch was abandoned)."""

  def __init__(self, shares: Shares, tenant: str, weight: float):
    self._shares = shares
    self.tenant = tenant
    self.weight = weight

  def __enter__(self) -> Turns:
    self._shares._enter(self.tenant, self.weight)
    return self

  def __exit__(self, *exc) -> None:
    self._shares._exit(self.tenant)

  def free(self) -> bool:
    """Whether a batch would go to a worker at once: the tenant is below its share."""
    return self._shares._free(self.tenant)

  def take(self) -> None:
    """Waits until the tenant is below its share, and counts one more batch of it.

    Only a caller with no batch of its own in flight may wait here (it waits for the
    tenant's other feeds, which end theirs); one with batches in flight asks ``free()``
    first and collects its own instead.
    """
    self._shares._take(self.tenant)

  def give(self, n: int = 1) -> None:
    if n:
      self._shares._give(self.tenant, n)


class Bandwidth:
  """The storage's writes on one sidecar, in turns, max-min fair among tenants by weight.

  At most ``total`` turns at once. A turn that comes free goes to the waiting tenant that
  wrote the least lately (its bytes over its weight, fading by half every ``half_life_s``);
  one tenant's waiters go in the order they came. So a tenant that asks for less than its
  share gets it as it asks, and one that asks for more takes what the others leave.

  A tenant writes a file's pieces one after another: between two of them it waits for
  nothing, but asks a moment after its turn ended. So the turn of a tenant that would go
  first anyway is kept for it ``anticipate_s`` (as the anticipatory disk scheduler keeps
  the disk for a sequential reader), else every piece of a light tenant would wait for a
  piece of the heavy one.
  """

  def __init__(self, total: int, *, half_life_s: float = HALF_LIFE_S,
               anticipate_s: float = ANTICIPATE_S, clock: Callable[[], float] = time.monotonic):
    if total < 1:
      raise ValueError(f"total must be at least 1, got {total!r}")
    self.total = total
    self._half_life_s, self._anticipate_s, self._clock = half_life_s, anticipate_s, clock
    self._cond = threading.Condition()
    self._busy = 0
    self._used: dict[str, tuple[float, float]] = {}  # tenant -> (bytes / weight, when)
    self._waiting: list[tuple[str, int]] = []  # (tenant, ticket), in the order they came
    self._kept: dict[str, float] = {}  # tenant -> until when a turn is kept for it
    self._tickets = itertools.count()

  def lately(self, tenant: str) -> float:
    """What ``tenant`` wrote lately, over its weight (bytes, faded)."""
    with self._cond:
      return self._lately(tenant, self._clock())

  def _lately(self, tenant: str, now: float) -> float:
    used, when = self._used.get(tenant, (0.0, now))
    return used * 0.5 ** ((now - when) / self._half_life_s)

  def _lightest(self, now: float, but: str | None = None) -> tuple[float, int] | None:
    """(what it wrote lately, its first ticket) of the waiting tenant that wrote least."""
    seen, best = set(), None
    for tenant, ticket in self._waiting:
      if tenant not in seen and tenant != but:
        seen.add(tenant)
        used = self._lately(tenant, now)
        if best is None or used < best[0]:
          best = (used, ticket)
    return best

  def _may_go(self, tenant: str, ticket: int, now: float) -> bool:
    """Whether waiter ``ticket`` of ``tenant`` takes a turn now (a kept one first)."""
    for t, until in list(self._kept.items()):
      if until <= now:
        del self._kept[t]
    mine = next(tk for t, tk in self._waiting if t == tenant) == ticket
    if tenant in self._kept:
      if mine:
        del self._kept[tenant]
      return mine
    lightest = self._lightest(now)
    return (self._busy + len(self._kept) < self.total and lightest is not None
            and lightest[1] == ticket)

  @contextlib.contextmanager
  def turn(self, tenant: str, nbytes: int, weight: float = 1.0) -> Iterator[None]:
    """A turn of ``tenant`` to write ``nbytes`` while the block runs (waits for it)."""
    with self._cond:
      ticket = next(self._tickets)
      self._waiting.append((tenant, ticket))
      try:
        while not self._may_go(tenant, ticket, now := self._clock()):
          kept = min(self._kept.values(), default=None)
          self._cond.wait(None if kept is None else max(kept - now, 0.0) + 1e-4)
      finally:
        self._waiting.remove((tenant, ticket))
        self._cond.notify_all()  # the next waiter may go, if a turn is free still
      self._busy += 1
      now = self._clock()
      self._used[tenant] = (self._lately(tenant, now) + nbytes / weight, now)
    try:
      yield
    finally:
      with self._cond:
        self._busy -= 1
        now = self._clock()
        lightest = self._lightest(now, but=tenant)
        if (self._anticipate_s > 0 and lightest is not None
            and self._lately(tenant, now) <= lightest[0]):
          self._kept[tenant] = now + self._anticipate_s  # it would go first: keep it
        self._cond.notify_all()
