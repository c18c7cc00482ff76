"""The arena's admission queue of a pool: reservations that do not fit yet wait their turn.

A tenant's request for arena bytes beyond what is free to it now waits here instead of
failing at once (``arenas/tenant_shares.TenantShares.reserve``). The queue is first in,
first out with two rules:

- a tenant's requests are served in the order they came: a later one never overtakes an
  earlier one of the same tenant;
- a request within its tenant's guaranteed share (``arena`` in the pool file) goes as soon
  as it fits: a small request of one tenant is never blocked behind another's big one.
  Only requests that borrow beyond their guarantee wait behind earlier ones of others
  that wait for free arena (not those that wait for their own ceiling).

Each waiter knows its position and an estimate of its wait, from the rate at which
blocks were freed lately. The queue holds no lock of its own: its owner's lock guards it.

A waiter whose client is being told its place (``Waiter.telling``) stands aside for other
tenants meanwhile: a client that reads none of its replies (its socket full) kept every
tenant from borrowing, the arena empty (issue 70, item 4). How many requests a tenant has
queued is bounded by its worker connections (``connections`` in the pool file: one alloc
in flight on each).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

# Frees over this many seconds make the rate an estimate of a wait is drawn from.
RATE_WINDOW_S = 30.0


@dataclasses.dataclass(eq=False, slots=True)
class Waiter:
  """One request waiting for arena bytes."""
  tenant: str
  nbytes: int
  ticket: int  # order of arrival
  since: float  # time.monotonic() when it came
  for_ceiling: bool = False  # waits for its own tenant's blocks, not for free arena
  telling: bool = False  # its client is being told its place: others' requests pass it


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
  """Where a waiter stands: what its trainer prints and its error says."""
  tenant: str
  position: int  # 1: next; among every waiter of the sidecar
  waiting: int  # waiters in all
  ahead_bytes: int  # bytes earlier waiters ask for
  eta_s: float | None  # None: nothing was freed lately, no estimate

  def to_dict(self) -> dict[str, object]:
    return dataclasses.asdict(self)

  def describe(self) -> str:
    eta = "no estimate yet" if self.eta_s is None else f"about {self.eta_s:.0f} s to go"
    return f"position {self.position} of {self.waiting} in the arena queue, {eta}"


class Queue:
  """The waiters of one sidecar's arena, in order of arrival; guarded by its owner's lock."""

  def __init__(self, window_s: float = RATE_WINDOW_S):
    self._waiters: list[Waiter] = []
    self._tickets = itertools.count()
    self._window_s = window_s
    self._frees: collections.deque[tuple[float, int]] = collections.deque()

  def join(self, tenant: str, nbytes: int) -> Waiter:
    w = Waiter(tenant, nbytes, next(self._tickets), time.monotonic())
    self._waiters.append(w)
    return w

  def leave(self, w: Waiter) -> None:
    if w in self._waiters:
      self._waiters.remove(w)

  def may_go(self, tenant: str, within_guarantee: bool, w: Waiter | None) -> bool:
    """Whether a request of ``tenant`` that fits now may take its bytes: no earlier
    waiter of its own tenant, and, beyond its guarantee, none of another waiting for free
    arena (but for one whose client is being told its place). ``w``: the request's place
    (None: it has not joined, every waiter is earlier)."""
    for other in self._waiters:
      if other is w:
        return True
      if other.tenant == tenant:
        return False
      if other.telling:  # its client may never read: it holds no other tenant up
        continue
      if not within_guarantee and not other.for_ceiling:
        return False
    return True

  def freed(self, nbytes: int) -> None:
    """Counts ``nbytes`` given back to the arena now (the rate estimates come from)."""
    now = time.monotonic()
    self._frees.append((now, nbytes))
    while self._frees and self._frees[0][0] < now - self._window_s:
      self._frees.popleft()

  def rate(self) -> float:
    """Bytes freed per second lately; 0 if none were."""
    now = time.monotonic()
    while self._frees and self._frees[0][0] < now - self._window_s:
      self._frees.popleft()
    if not self._frees:
      return 0.0
    span = max(now - self._frees[0][0], 1.0)
    return sum(n for _, n in self._frees) / span

  def place(self, w: Waiter, short_bytes: int) -> Place:
    """Where ``w`` stands; ``short_bytes``: what it lacks now beyond what earlier waiters
    ask for (its estimate counts both)."""
    index = self._waiters.index(w) if w in self._waiters else len(self._waiters)
    ahead = sum(o.nbytes for o in self._waiters[:index] if not o.for_ceiling)
    rate = self.rate()
    need = max(short_bytes, 0) + (0 if w.for_ceiling else ahead)
    eta = None if rate <= 0 else need / rate
    return Place(w.tenant, index + 1, len(self._waiters), ahead, eta)

  def counts(self) -> dict[str, int]:
    """Waiters per tenant."""
    return dict(collections.Counter(w.tenant for w in self._waiters))

  def __len__(self) -> int:
    return len(self._waiters)
