"""Who holds which arena block, so a block is reused only when nobody can read it.

A block can have several holders at once: a worker session (its connection),
and local pins (a live numpy view inside the sidecar). It goes back to the
allocator when the last holder lets go. Closing a session, which happens when
a worker's connection drops for any reason, lets go of everything it held.

With a pool file each tenant's blocks are in its own arena (``arenas.py``): a block is
named by its arena and offset, and a holder's blocks are all in one arena, the one its
worker session was handed (or, for a pin, its tenant's): a reference resolves only there.
How much of the arenas each tenant may take is ``tenant_shares.py``'s, asked here.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server import metrics as metrics_lib
from sidecar._src.server.arenas import arenas as arenas_lib, tenant_shares
from sidecar._src.server.arenas.tenant_shares import ON_WAIT_S, Key
from sidecar._src.server.pool import admission
from sidecar._src.server.tenancy import quotas as quotas_lib, tenants as tenants_lib

QUOTA_FLAG = "--session-quota"
# What one worker session may hold of the arena by default: the rest stays for the others.
DEFAULT_QUOTA = 0.9
# Where the arena is full and durable RAM-tier copies gave way (``reclaim``), how long an
# allocation waits for their blocks to come back, past a deadline of 0 too; and how often
# one that waits asks again (a step may have become durable).
RECLAIM_WAIT_S = 1.0
RECLAIM_POLL_S = 0.5


class Leases:
  """Reference-counted holders over the allocators of :class:`arenas.Arenas` (or one
  :class:`shm.Allocator`).

  ``quota``: the most bytes one worker session (a ``str`` holder) may allocate while it
  holds what it has: so no client takes the whole arena from the others. None: no quota.

  With tenants (``tenancy``; ``tenant_of``: a worker session's tenant, others count as
  ``tenants.CURRENT``'s), a block counts against the tenant that allocated it until it is
  freed, whoever holds it then (the RAM tier keeps a save's blocks): a tenant never holds
  more than its ``arena_ceiling``, and never takes what other tenants are guaranteed
  (``arena``) and do not use yet. A tenant's request that does not fit now waits its turn
  in the :class:`admission.Queue` (within its timeout; ``metrics``: where its wait counts).

  ``reclaim(nbytes, tenant)``: where the arena is full, lets go of about ``nbytes`` that
  can give way (the RAM tier's durable copies; ``tenant``: whose request needs them) and
  returns how many; ``holds(tenant)`` says what holds the arena besides, for the error that
  goes to ``tenant``'s request (it names only what that tenant may see).
  """

  def __init__(self, arenas: arenas_lib.Arenas | shm.Allocator, *, quota: int | None = None,
               quota_share: float | None = None,
               tenancy: tenants_lib.Tenancy | None = None,
               tenant_of: Callable[[str], str | None] = lambda session: None,
               metrics: metrics_lib.Recorder = metrics_lib.OFF,
               reclaim: Callable[[int, str | None], int] | None = None,
               holds: Callable[[str | None], str] = lambda tenant: ""):
    self.arenas = (arenas if isinstance(arenas, arenas_lib.Arenas)
                   else arenas_lib.Arenas.of_allocator(arenas))
    # The figures of all arenas together, as one allocator's (size, used_bytes, num_blocks).
    self.allocator = self.arenas
    self._reclaim, self.holds = reclaim, holds
    self.quota = quota
    # The quota as a share of the arena (sidecar serve --session-quota 0.9), or None
    # (bytes, or none): whether a larger arena raises it.
    self.quota_share = quota_share
    self._tenancy, self._tenant_of = tenancy, tenant_of
    self._lock = threading.Lock()
    self._freed = threading.Condition(self._lock)  # a block let go of: a quota may have room
    # What each tenant holds of the arenas and may take, under the same lock.
    self._tenant_shares = tenant_shares.TenantShares(
        self.arenas, tenancy, lock=self._lock, freed=self._freed, metrics=metrics,
        reclaim=reclaim)
    self._holders: dict[Key, tuple[shm.Block, set[Hashable]]] = {}
    self._by_holder: dict[Hashable, set[Key]] = {}
    self._bytes: dict[Hashable, int] = {}  # bytes each holder holds
    self._arena_of: dict[Hashable, int] = {}  # the arena of each holder's blocks
    self._pins = itertools.count()

  def new_pin(self, arena: int | None = None) -> tuple:
    """A fresh holder token for a local pin; ``arena``: the arena its block is made in
    (default: its tenant's, ``tenants.CURRENT``)."""
    return ("pin", next(self._pins)) if arena is None else ("pin", next(self._pins), arena)

  def _bound(self, holder: Hashable) -> int | None:
    """The arena ``holder`` is bound to: that of the blocks it holds, the one its pin
    names, or the one its worker session was handed; None: its tenant's, whichever."""
    found = self._arena_of.get(holder)
    if found is not None:
      return found
    if isinstance(holder, tuple) and len(holder) == 3 and holder[0] == "pin":
      return holder[2]
    if isinstance(holder, str):
      s = self.arenas.of_session(holder)
      if s is not None:
        return s.id
    return None

  def _arena(self, holder: Hashable) -> int | None:
    """The arena ``holder``'s blocks are in (None: it holds none, and has none bound)."""
    found = self._bound(holder)
    if found is not None:
      return found
    s = self.arenas.current(self._tenant_name(holder))
    return None if s is None else s.id

  def _key(self, offset: int, holder: Hashable) -> Key:
    arena = self._arena(holder)
    return (-1 if arena is None else arena, offset)

  def arena_of(self, block: shm.Block) -> shm.Arena:
    """The mapping ``block`` lies in."""
    return self.arenas.arena(block.arena)

  def space_of(self, holder: Hashable) -> arenas_lib.Space | None:
    """The arena ``holder`` (a worker session, a pin) makes and reads blocks in, if any."""
    arena = self._arena(holder)
    return None if arena is None else self.arenas.get(arena)


  def alloc(self, nbytes: int, holder: Hashable, *, timeout: float | None,
            alive: Callable[[], bool] | None = None,
            on_wait: Callable[[admission.Place], None] | None = None,
            report_s: float = ON_WAIT_S) -> shm.Block:
    """A new block held by ``holder``, waiting up to ``timeout`` s (None: for ever) for
    room in the arena, and in ``holder``'s quota if it is a worker session.

    A tenant's request waits in the admission queue; ``on_wait`` is told its place every
    ``report_s`` seconds, and ``alive`` (asked as often) ends the wait when its caller is
    gone.

    Raises:
      ResourceExhaustedError: no room in time; the message gives the sizes (a tenant's:
        its name, its place in the queue and its quota).
      ClosedError: ``alive`` said its caller is gone.
    """
    if not self.fits(nbytes, holder):
      raise self.never_fits(nbytes, holder)
    deadline = None if timeout is None else time.monotonic() + timeout
    if self.quota is not None and isinstance(holder, str):
      with self._lock:
        while self._bytes.get(holder, 0) + nbytes > self.quota:
          left = None if deadline is None else deadline - time.monotonic()
          if left is not None and left <= 0:
            raise self._past_quota(nbytes, holder)
          self._freed.wait(left)
    tenant = self._tenant(holder)
    if tenant is not None:
      self._tenant_shares.reserve(tenant, nbytes, deadline, alive, on_wait, report_s,
                                  held_by=lambda name: self.held_by(name, locked=True))
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    bound = self._bound(holder)  # else its tenant's arena, made if it has none yet
    try:
      # Kept open (a retired arena closes with its last user) until the block is in it.
      space = self.arenas.enter(None if bound is not None else self._tenant_name(holder),
                                space=bound)
      try:
        block = self._take(space.allocator, nbytes,
                           None if tenant is None else tenant.name, deadline)
      finally:
        self.arenas.leave(space)
    except BaseException:
      if tenant is not None:
        self._tenant_shares.cancel(tenant, nbytes)
      raise
    key = (block.arena, block.offset)
    with self._lock:
      if tenant is not None:
        self._tenant_shares.allocated(tenant, nbytes, key, block.nbytes)
      self._holders[key] = (block, {holder})
      self._by_holder.setdefault(holder, set()).add(key)
      self._arena_of[holder] = block.arena
      self._bytes[holder] = self._bytes.get(holder, 0) + block.nbytes
    self.arenas.made(block)
    return block

  def _take(self, allocator: shm.Allocator, nbytes: int, tenant: str | None,
            deadline: float | None) -> shm.Block:
    """A block from ``allocator`` (an arena's) by ``deadline``; where the arenas are full,
    durable RAM-tier copies give way first, and are asked again while it waits (a step may
    become durable). The lock is not held."""
    start, reclaimed = time.monotonic(), tenant_shares.Reclaimed()
    while True:
      left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
      if self._reclaim is None:
        return allocator.alloc(nbytes, timeout=left)
      try:
        return allocator.alloc(nbytes, timeout=0.0)
      except errors.ResourceExhaustedError:
        if not allocator.fits(nbytes):
          raise
      free = self.allocator.size - self.allocator.used_bytes
      short = reclaimed.short(nbytes - free, free)
      # Room free but split: one block more, unless what went has yet to come back.
      ask = max(short, shm.ALIGN) if short > 0 or not reclaimed.outstanding else 0
      freed = reclaimed.add(self._reclaim(ask, tenant)) if ask else 0
      if not freed and left is not None and left <= 0:
        raise shm.arena_full(nbytes, free=free, size=self.allocator.size,
                             waited=time.monotonic() - start, holds=self.held_by(tenant))
      wait = RECLAIM_WAIT_S if freed else RECLAIM_POLL_S
      try:
        return allocator.alloc(nbytes, timeout=wait if left is None or freed else
                               min(wait, left))
      except errors.ResourceExhaustedError:
        continue

  def held_by(self, tenant: str | None = None, *, locked: bool = False) -> str:
    """What holds the arena now: worker sessions, the sidecar itself, and of that the RAM
    tier's steps (``holds``), for an error about a full arena that goes to ``tenant``'s
    request; ``locked``: the caller holds the lock."""
    by_session, pinned = self._held_bytes() if locked else self.held_bytes()
    fmt = shm.format_size
    ram = self.holds(tenant)
    return (f"it holds {fmt(sum(by_session.values()))} for {len(by_session)} worker "
            f"session(s) (their arrays, feed batches not yet freed, saves being copied in) and "
            f"{fmt(pinned)} for the sidecar itself (feed batches in flight, staged saves, "
            f"reads{', ' + ram if ram else ''})")

  def spare(self, tenant: str) -> int:
    """The arena bytes ``tenant`` holds beyond its guaranteed arena (0 outside a pool)."""
    return self._tenant_shares.spare(tenant)

  def waiting(self) -> dict[str, int]:
    """The requests of each tenant waiting in the admission queue now."""
    return self._tenant_shares.waiting()

  def tenant_bytes(self) -> dict[str, int]:
    """The arena bytes each tenant allocated and are not freed yet."""
    return self._tenant_shares.tenant_bytes()

  def held_for(self, holder: Hashable) -> str:
    """What the RAM tier holds of the arena, as an error to ``holder``'s request says it."""
    return self.holds(self._tenant_name(holder))

  def _tenant_name(self, holder: Hashable) -> str | None:
    return self._tenant_of(holder) if isinstance(holder, str) else tenants_lib.CURRENT.get()

  def _tenant(self, holder: Hashable) -> tenants_lib.Tenant | None:
    if self._tenancy is None:
      return None
    return self._tenancy.tenant(self._tenant_name(holder))

  def queued(self, holder: Hashable) -> bool:
    """Whether ``holder``'s requests wait their turn in the admission queue: a tenant's of
    a pool file. The older modes' tenants (a shared token, --client-tokens) have no queue:
    their requests past a quota are refused at once, as before pools."""
    pool = None if self._tenancy is None else self._tenancy.pool
    return pool is not None and pool.quotas and self._tenant(holder) is not None

  def fits(self, nbytes: int, holder: Hashable) -> bool:
    """Whether ``holder`` could ever get a block of ``nbytes``: in an empty arena, and
    within its quota if it is a worker session."""
    t = self._tenant(holder)
    ceiling = None if t is None else self._tenant_shares.share(t)[1]
    if ceiling is not None and nbytes > ceiling:
      return False
    if t is not None and nbytes > self._tenant_shares.open_to(t):
      return False
    return self.allocator.fits(nbytes) and (
        self.quota is None or not isinstance(holder, str) or nbytes <= self.quota)

  def tenant_limited(self, holder: Hashable) -> bool:
    """Whether ``holder`` is a pool tenant's, whose arena the pool file divides."""
    return self._tenant(holder) is not None

  def never_fits(self, nbytes: int, holder: Hashable = None) -> errors.ResourceExhaustedError:
    """The error of a block of ``nbytes`` that ``holder`` can never get (``fits`` said so):
    what it passes (the arena, a tenant's share, a session's quota) and the fix."""
    fmt = shm.format_size
    if not self.allocator.fits(nbytes):
      return errors.ResourceExhaustedError(
          f"a block of {fmt(nbytes)} ({nbytes} bytes) cannot fit an arena of "
          f"{fmt(self.allocator.size)}; raise --shm-size to {self.shm_size_for(nbytes)} at "
          f"least (LocalCluster's shm_size=\"{self.shm_size_for(nbytes)}\")")
    t = self._tenant(holder)
    ceiling = None if t is None else self._tenant_shares.share(t)[1]
    if t is not None and nbytes > (open_to := self._tenant_shares.open_to(t)) and (
        ceiling is None or nbytes <= ceiling):
      where = self._tenancy.where(t.name) if self._tenancy is not None else ""
      return errors.ResourceExhaustedError(
          f"tenant {t.name!r}: a block of {fmt(nbytes)} ({nbytes} bytes) can never fit: the "
          f"other tenants' guaranteed arena leaves it {fmt(open_to)} of "
          f"{fmt(self.allocator.size)} ({where}); use smaller arrays, or lower the others' "
          "guaranteed arena in the pool file")
    if t is not None and ceiling is not None and nbytes > ceiling:
      where = self._tenancy.where(t.name) if self._tenancy is not None else ""
      return errors.ResourceExhaustedError(
          f"tenant {t.name!r}: a block of {fmt(nbytes)} ({nbytes} bytes) cannot fit its "
          f"quota (arena_ceiling={quotas_lib.ARENA_CEILING.of(t)} = {fmt(ceiling)}, {where}); "
          "raise its "
          "arena_ceiling in the pool file, or use smaller arrays")
    return errors.ResourceExhaustedError(
        f"a block of {fmt(nbytes)} ({nbytes} bytes) cannot fit a worker session's quota of "
        f"{fmt(self.quota or 0)} (of an arena of {fmt(self.allocator.size)}: sidecar serve "
        f"{QUOTA_FLAG}); raise the quota"
        + (f", or --shm-size to {self.shm_size_for(nbytes, holder)} at least (LocalCluster's "
           f"shm_size=\"{self.shm_size_for(nbytes, holder)}\")" if self.quota_share else ""))

  def shm_size_for(self, nbytes: int, holder: Hashable = None) -> str:
    """The --shm-size whose arena would give ``holder`` (a worker session: within its
    quota, where that is a share of the arena) ``nbytes`` at once."""
    share = self.quota_share if isinstance(holder, str) and self.quota is not None else None
    return shm.shm_size_of(-(-nbytes // shm.ALIGN) * shm.ALIGN / (share or 1.0))

  def _past_quota(self, nbytes: int, holder: str) -> errors.ResourceExhaustedError:
    fmt, a = shm.format_size, self.allocator
    free = a.size - a.used_bytes
    full = (f"; the arena is full too ({fmt(free)} free of {fmt(a.size)})"
            if free < nbytes else "")
    return errors.ResourceExhaustedError(
        f"worker session {holder} holds {fmt(self._bytes.get(holder, 0))} of the arena; "
        f"{fmt(nbytes)} more would pass its quota of {fmt(self.quota or 0)} (of "
        f"{fmt(a.size)}: sidecar serve {QUOTA_FLAG}){full}; free arrays sooner, or raise "
        "the quota" + (" or --shm-size" if full else ""))

  def bytes_of(self, holder: Hashable) -> int:
    """The bytes of the blocks ``holder`` holds."""
    with self._lock:
      return self._bytes.get(holder, 0)

  def hold(self, offset: int, generation: int, holder: Hashable, *,
           arena: int | None = None) -> shm.Block:
    """Adds ``holder`` to a live block (of ``arena``; default: ``holder``'s arena);
    StaleDescriptorError if it is gone."""
    with self._lock:
      key = self._key(offset, holder) if arena is None else (arena, offset)
      entry = self._holders.get(key)
      if entry is None or entry[0].generation != generation:
        raise errors.StaleDescriptorError(
            f"arena block at offset {offset} generation {generation} is not allocated "
            "(released or reused since the descriptor was made)")
      self._add(key, entry, holder)
      return entry[0]

  def _add(self, key: Key, entry: tuple[shm.Block, set[Hashable]], holder: Hashable) -> None:
    """``holder`` holds the block ``entry`` too; the lock is held."""
    found = self._arena_of.get(holder)
    if found is not None and found != key[0]:
      raise errors.InvalidArgumentError(
          f"{holder!r} holds blocks of arena {found}; it cannot hold one of arena {key[0]}")
    if holder not in entry[1]:
      self._bytes[holder] = self._bytes.get(holder, 0) + entry[0].nbytes
    entry[1].add(holder)
    self._by_holder.setdefault(holder, set()).add(key)
    self._arena_of[holder] = key[0]

  def hold_owned(self, offset: int, generation: int, nbytes: int, *, owner: Hashable,
                 holder: Hashable) -> shm.Block:
    """Adds ``holder`` to a live block that ``owner`` holds, if ``nbytes`` fit in it.

    Everything is checked before the hold is taken, so a refused reference holds
    nothing. A block that is missing, of another generation or not ``owner``'s
    gets one and the same StaleDescriptorError: a client learns nothing about
    blocks that are not its own.
    """
    with self._lock:
      key = self._key(offset, owner)
      entry = self._holders.get(key)
      if entry is None or entry[0].generation != generation or owner not in entry[1]:
        space = self.arenas.get(key[0])
        if self.arenas.per_tenant and space is not None and space.tenant is not None:
          # Its own arena is all a tenant's worker can name: another's block is not in it.
          raise errors.InvalidArgumentError(
              f"the arena block at offset {offset} generation {generation} is not one of "
              f"the blocks of tenant {space.tenant!r} that this worker session holds (each "
              f"tenant has an arena of its own, {space.size} bytes here: released, reused, "
              "or never its own); send arrays the worker holds, e.g. from worker.put() or "
              "the results of its calls")
        raise errors.StaleDescriptorError(
            f"no arena block at offset {offset} generation {generation} is held by "
            "this worker session (released, reused, or never its own); send arrays the "
            "worker holds, e.g. from worker.put() or the results of its calls")
      block = entry[0]
      if not 0 < nbytes <= block.nbytes:
        raise errors.InvalidArgumentError(
            f"nbytes {nbytes} does not fit the arena block at offset {offset}, "
            f"which has {block.nbytes} bytes")
      self._add(key, entry, holder)
      return block

  def block_at(self, offset: int, *, arena: int = 0) -> shm.Block | None:
    """The live block of ``arena`` that starts at ``offset``, if any."""
    with self._lock:
      entry = self._holders.get((arena, offset))
    return None if entry is None else entry[0]

  def release(self, offset: int, generation: int, holder: Hashable) -> None:
    with self._lock:
      key = self._key(offset, holder)
      entry = self._holders.get(key)
      if entry is None or entry[0].generation != generation or holder not in entry[1]:
        raise errors.StaleDescriptorError(
            f"arena block at offset {offset} generation {generation} is not held by {holder!r}")
      freed = self._drop(key, holder)
    if freed:
      self.arenas.freed(key[0])

  def release_each(self, pairs: list[int], holder: Hashable, *,
                   chunk: int = 4096) -> tuple[int, list[tuple[int, int]]]:
    """``holder`` lets go of the blocks ``pairs`` names, flattened (offset, generation)
    pairs: how many it let go of, and the first 8 pairs it did not hold (stale).

    One lookup a pair and no error object made for a stale one, so a frame of 1 MiB of
    pairs costs tens of milliseconds however many are stale; the lock is taken once per
    ``chunk`` pairs, so other sessions' allocs never wait long behind it.
    """
    released, stale, arenas = 0, [], set()
    for start in range(0, len(pairs) - 1, 2 * chunk):
      part = pairs[start:start + 2 * chunk]
      with self._lock:
        for offset, generation in zip(part[::2], part[1::2]):
          key = self._key(offset, holder)
          entry = self._holders.get(key)
          if entry is None or entry[0].generation != generation or holder not in entry[1]:
            if len(stale) < 8:
              stale.append((offset, generation))
            continue
          released += 1
          if self._drop(key, holder):
            arenas.add(key[0])
    for arena in arenas:
      self.arenas.freed(arena)
    return released, stale

  def release_all(self, holder: Hashable) -> int:
    """Lets go of every block ``holder`` has; returns how many."""
    with self._lock:
      keys = self._by_holder.pop(holder, set())
      arenas = set()
      for key in keys:
        self._by_holder.setdefault(holder, set()).add(key)
        if self._drop(key, holder):
          arenas.add(key[0])
      self._by_holder.pop(holder, None)
      self._arena_of.pop(holder, None)
    for arena in arenas:
      self.arenas.freed(arena)
    return len(keys)

  def _drop(self, key: Key, holder: Hashable) -> bool:
    """``holder`` lets go of block ``key``; whether that freed it. The lock is held."""
    block, holders = self._holders[key]
    if holder in holders:
      left = self._bytes.get(holder, 0) - block.nbytes
      if left > 0:
        self._bytes[holder] = left
      else:
        self._bytes.pop(holder, None)
      self._freed.notify_all()
    holders.discard(holder)
    mine = self._by_holder.get(holder)
    if mine is not None:
      mine.discard(key)
      if not mine:
        del self._by_holder[holder]
        self._arena_of.pop(holder, None)
    if holders:
      return False
    del self._holders[key]
    space = self.arenas.get(key[0])
    if space is not None:  # else closed with the sidecar: nothing to give back
      space.allocator.free(block.offset, block.generation)
    self._tenant_shares.freed(key, block.nbytes)
    return True

  def held_bytes(self) -> tuple[dict[str, int], int]:
    """Bytes each worker session (a str holder) holds, and bytes held by local pins only."""
    with self._lock:
      return self._held_bytes()

  def _held_bytes(self) -> tuple[dict[str, int], int]:
    """``held_bytes``; the lock is held."""
    by_session: dict[str, int] = {}
    pinned = 0
    for block, holders in self._holders.values():
      sessions = [h for h in holders if isinstance(h, str)]
      for h in sessions:
        by_session[h] = by_session.get(h, 0) + block.nbytes
      if not sessions:
        pinned += block.nbytes
    return by_session, pinned

  def holders(self) -> int:
    with self._lock:
      return len(self._by_holder)
