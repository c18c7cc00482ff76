"""Feed workers shared fairly among a pool's tenants with work, by weight (issue 37).

A tenant's ``feed_workers`` quota (``tenants.Tenancy.feeding``) bounds the worker processes
it may start, but the host's CPUs are one for everybody: a tenant running 16 workers on 2
cores would take most of them from the others' feeds. So the batches feed workers fill at
once on a sidecar are shared among the tenants that run a feed now, as ``limits.py`` shares
a total among tenants: a tenant's share of ``total`` (the host's CPUs) is
``max(1, int(total * weight / sum of the weights of the tenants with a feed))``. A tenant
alone with work uses all of them; a tenant at its share waits for one of its own batches to
end, never for another tenant's. A feed without workers counts as work too (it fills its
batches on a sidecar thread), so its tenant's presence shrinks a hog's share.
"""

from __future__ import annotations

import threading


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
