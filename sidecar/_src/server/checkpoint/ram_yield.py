"""How the RAM tier gives way: its durable copies are a cache, never a reservation.

A step's RAM-tier copy (this host's own shards and the replicas it holds of it) is
*durable* once the step is committed on storage: dropping it loses nothing but a fast
restore. :class:`Yielding` drops such copies when new work needs their arena room
(``reclaim``, which the arena's allocation path calls before it fails or waits: oldest
commit first; in a pool the needing tenant's own copies first, then those of directories
of no tenant, then other tenants' only where they hold more than their guaranteed arena),
or when an operator asks (``drop``). A step not durable yet (being written, or written
and waiting for its commit) is never dropped: the work that needs its room waits for
its commit within its deadline, or fails saying what holds the arena (``describe``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from sidecar._src.arena import shm
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.checkpoint.copies import Replica
from sidecar._src.server.checkpoint.lifecycle import Reason
from sidecar._src.server.checkpoint.ram_tier import Holdings, RamTier
from sidecar._src.server.checkpoint.step import Step

log = logging.getLogger(__name__)
# How long ``reclaim`` and ``describe`` wait for the RAM tier's lock: an allocation that
# asks for room gets nothing rather than waiting behind a busy tier (none runs under it:
# the tier makes a replica's block outside its lock).
LOCK_WAIT_S = 0.2


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
  """One step's RAM-tier copy on this host: own shards and replicas together."""
  directory: str
  step: int
  nbytes: int
  group: str | None  # the pool tenant whose directory it is (None: no pool, or none)
  state: Reason  # durable, or why not: being written, waiting for its commit, ...

  @property
  def durable(self) -> bool:
    return self.state is Reason.DURABLE


def copies(holdings: Holdings) -> list[Copy]:
  """The copies a RAM tier holds (``RamTier.holdings``): durable ones oldest commit first,
  then the others by step."""
  merged: dict[tuple[str, int], list] = {}  # (directory, step) -> [bytes, state, final_dir]
  held: list[Step | Replica] = [*holdings.steps, *holdings.replicas]
  for one in held:
    entry = merged.setdefault((one.directory, one.step), [0, Reason.DURABLE, one.final_dir])
    entry[0] += one.nbytes
    if entry[1] is Reason.DURABLE:  # durable once every part is: a step's reason is its
      # view's (``lifecycle.VIEWS``), a replica is durable once committed
      entry[1] = (one.view().copy if isinstance(one, Step)
                  else Reason.DURABLE if one.committed else Reason.ON_ITS_WAY)
  commits = {final_dir: i for i, final_dir in enumerate(holdings.commits)}
  order = sorted(merged, key=lambda k: (merged[k][1] is not Reason.DURABLE,
                                        commits.get(merged[k][2], len(commits)), k[1]))
  return [Copy(directory, step, merged[directory, step][0], holdings.group_of(directory),
               merged[directory, step][1])
          for directory, step in order]


def describe(held: list[Copy], visible: Callable[[str], bool] | None = None) -> str:
  """What ``held`` holds of the arena, per directory and state, for an error's message.

  ``visible(directory)``: whether the client the error goes to may see that directory
  (None: every one); the other clients' copies are summed, their directories unnamed.
  """
  if not held:
    return "no RAM-tier steps"
  parts: dict[tuple[str, Reason], list[Copy]] = {}
  hidden: dict[bool, int] = {}  # durable or not -> bytes of directories not shown
  for c in held:
    if visible is None or visible(c.directory):
      parts.setdefault((c.directory, c.state), []).append(c)
    else:
      hidden[c.durable] = hidden.get(c.durable, 0) + c.nbytes
  text = []
  for (directory, state), group in parts.items():
    steps = ", ".join(str(c.step) for c in group)
    size = shm.format_size(sum(c.nbytes for c in group))
    why = ("durable, still read or held elsewhere" if state is Reason.DURABLE
           else f"{state}: not durable yet, kept")
    text.append(f"{directory} step{'s' if len(group) > 1 else ''} {steps} ({size}, {why})")
  for durable, nbytes in sorted(hidden.items()):
    why = "durable, still read or held elsewhere" if durable else "not durable yet, kept"
    text.append(f"other clients' steps ({shm.format_size(nbytes)}, {why})")
  return "RAM-tier steps: " + "; ".join(text)


class Yielding:
  """Drops ``tier``'s durable copies for new work (``reclaim``) or on request (``drop``).

  ``spare(tenant)``: the arena bytes a pool tenant holds beyond its guaranteed arena, of
  which its copies may go for another tenant's work.
  """

  def __init__(self, tier: RamTier, *, metrics: metrics_lib.Recorder = metrics_lib.OFF,
               spare: Callable[[str], int] = lambda tenant: 0):
    self._tier = tier
    self._metrics = metrics
    self.spare = spare

  def reclaim(self, nbytes: int, tenant: str | None = None) -> int:
    """Drops durable copies, oldest commit first, until about ``nbytes`` are let go of
    (their blocks come back as their views die); returns the bytes let go of.

    ``tenant``: whose work needs the room (a pool's tenant): its own copies go first,
    then those of no tenant, then other tenants' where beyond their guarantee.
    """
    tier = self._tier
    held = tier.holdings(timeout=LOCK_WAIT_S) if nbytes > 0 else None
    if held is None:
      return 0
    gone = self._choose(copies(held), nbytes, tenant)  # outside the tier's lock: spare()
    if not tier.drop([(c.directory, c.step) for c in gone], timeout=LOCK_WAIT_S):
      return 0
    for c in gone:
      self._metrics.ram_tier_evicted("room", c.nbytes)
      log.info("step %d of %s leaves the RAM tier of host %d: new work%s needs %s of the "
               "arena; its durable copy on storage stays (%s let go of)", c.step, c.directory,
               tier.host_id, f" of tenant {tenant!r}" if tenant else "",
               shm.format_size(nbytes), shm.format_size(c.nbytes), extra={"step": c.step})
    return sum(c.nbytes for c in gone)

  def _choose(self, held: list[Copy], nbytes: int, tenant: str | None) -> list[Copy]:
    """The durable copies of ``held`` that :meth:`reclaim` lets go of, in its order."""
    gone: list[Copy] = []
    durable = [c for c in held if c.durable]
    if tenant is not None:
      durable = ([c for c in durable if c.group == tenant]
                 + [c for c in durable if c.group is None]
                 + [c for c in durable if c.group not in (None, tenant)])
    spare: dict[str, int] = {}
    for c in durable:
      if sum(g.nbytes for g in gone) >= nbytes:
        break
      if tenant is not None and c.group not in (None, tenant):
        left = spare[c.group] if c.group in spare else self.spare(c.group)
        if left < c.nbytes:  # within its guarantee: it stays
          spare[c.group] = left
          continue
        spare[c.group] = left - c.nbytes
      gone.append(c)
    return gone

  def drop(self, match: Callable[[str], bool]) -> tuple[list[Copy], list[Copy]]:
    """Drops the durable copies of the directories ``match`` accepts (resolved paths);
    returns those dropped and those kept (not durable yet)."""
    tier = self._tier
    held = tier.holdings()
    assert held is not None  # (it waits for the lock)
    mine = [c for c in copies(held) if match(os.path.realpath(c.directory))]
    tier.drop([(c.directory, c.step) for c in mine if c.durable])
    dropped = [c for c in mine if c.durable]
    kept = [c for c in mine if not c.durable]
    for c in dropped:
      self._metrics.ram_tier_evicted("operator", c.nbytes)
      log.info("step %d of %s leaves the RAM tier of host %d: dropped on request; its durable "
               "copy on storage stays (%s let go of)", c.step, c.directory, tier.host_id,
               shm.format_size(c.nbytes), extra={"step": c.step})
    for c in kept:
      log.info("step %d of %s stays in the RAM tier of host %d although asked to drop it: %s, "
               "it is not durable yet", c.step, c.directory, tier.host_id, c.state,
               extra={"step": c.step})
    return dropped, kept

  def describe(self, visible: Callable[[str], bool] | None = None) -> str:
    """What the RAM tier holds, for an error about a full arena; ``visible``: as
    :func:`describe`'s."""
    held = self._tier.holdings(timeout=LOCK_WAIT_S)
    if held is None:
      return "RAM-tier steps: (busy, not listed)"
    return describe(copies(held), visible)
