"""The arenas of one sidecar: one for everyone, or one per pool tenant.

Outside a pool file a sidecar has one arena, made and pre-faulted at start, that every
Worker maps (:meth:`Arenas.single`). With a pool file each tenant's blocks (its feeds'
batches, staged saves, RAM-tier copies, replicas held for it) live in an arena of its own:
a memfd as large as its ``arena_ceiling`` (the whole ``--shm-size`` without one), handed
only to its own Workers and its feeds' worker processes. Another tenant's block is simply
not in that memory: a reference to it does not resolve, and a mapping shows nothing of it.
Blocks nobody can tell to a tenant (another sidecar's, before it says whose) go to an
arena of the sidecar's own, handed to no tenant.

Memory. The tenants' arenas together hand out at most ``--shm-size`` (one
:class:`shm.Budget`; the pool's guaranteed shares and ceilings are ``leases.Leases``'),
while the sum of their ceilings may pass it: so no page is made in advance. A page is
made when first written; a freed block keeps its pages (the next block there costs no
page faults). What an arena's pages may hold is bounded by its top (the end of the highest
block made since its free pages were last punched) or what they held at the last look;
a block below its top costs nothing (:meth:`Arenas.made`). Before a block that raises a
top could take the arenas past ``--shm-size`` (as the kernel counts them: each memfd's
pages), the pages of free ranges are punched out (``MADV_REMOVE``), whole arenas at a
time, those that keep the most first, until it fits. Pages a Worker writes outside its
blocks are counted at the next look (when a block is made, ``MEASURE_S`` or more after the
last) and punched like any free range. So what the arenas hold stays within
``--shm-size``, as one pre-faulted arena did.

Lifetime. An arena stays while a Worker of its tenant is attached, a feed of it runs or
a block of it lives. A tenant removed from the pool file (or whose token changed) has
its arena retired: no new block goes there, and once its last block is released its pages
are punched and the sidecar's fd and mapping closed. Whatever another tenant writes later
is in another memfd, which the removed tenant's processes never had.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

from sidecar._src.arena import shm
from sidecar._src.core import errors

log = logging.getLogger(__name__)

# How often, at most, the pages resident in the arenas are left unmeasured while blocks
# are made: pages a Worker writes outside its blocks are found within this.
MEASURE_S = 1.0


@dataclasses.dataclass(eq=False)
class Space:
  """One arena and its allocator: the whole sidecar's, or one tenant's.

  ``users``: Workers bound to it, feeds that run in it, requests making a block in it:
  while any (or a block) is left it stays open.
  """
  id: int
  tenant: str | None
  arena: shm.Arena | None  # None: not mapped (Leases alone, in unit tests)
  allocator: shm.Allocator
  users: int = 0
  retired: bool = False
  closed: bool = False
  # What its pages may hold (``Arenas.made``): the end of the highest block made since its
  # free pages were last punched, and the bytes its pages held at the last look.
  top: int = 0
  measured: int = 0

  @property
  def size(self) -> int:
    return self.allocator.size

  def resident_bytes(self) -> int:
    return self.allocator.used_bytes if self.arena is None else self.arena.resident_bytes()


class Arenas:
  """The arenas of one sidecar, and the :class:`shm.Budget` they share.

  Args:
    size: ``--shm-size``: what all arenas hand out together.
    per_tenant: one arena per tenant (a pool file); else one for all, made at once.
    ceiling_of: tenant ``name``'s arena size in bytes (its ``arena_ceiling``), None if it
      is no tenant of the pool now (its blocks then go to the sidecar's own arena).
  """

  def __init__(self, size: int, *, per_tenant: bool,
               ceiling_of: Callable[[str], int | None] = lambda name: None,
               make: Callable[[int, str], shm.Arena | None] | None = None):
    self.size = size
    self.per_tenant = per_tenant
    self.budget = shm.Budget(size)
    self._ceiling_of = ceiling_of
    self._make = make or (lambda nbytes, name: shm.Arena.create(nbytes, name=name,
                                                                reserve=False))
    self._lock = threading.Lock()
    self._ids = itertools.count()
    self._spaces: dict[int, Space] = {}  # open ones, by id
    self._current: dict[str | None, Space] = {}  # where each tenant's new blocks go
    self._sessions: dict[str, Space] = {}  # worker session -> the arena it was handed
    self._measured = -float("inf")  # when the arenas' pages were last looked at
    self.punches = 0  # arenas whose free pages were punched, in all (for tests, benchmarks)
    # Outside a pool: the one arena, for everyone, for good (no lock needed to find it).
    self._one: Space | None = None

  @classmethod
  def single(cls, arena: shm.Arena | None, *, size: int | None = None) -> Arenas:
    """One arena for everyone (no pool file); ``arena`` None: not mapped, of ``size``."""
    n = arena.size if arena is not None else int(size or 0)
    arenas = cls(n, per_tenant=False)
    space = Space(next(arenas._ids), None, arena,
                  shm.Allocator(n, budget=arenas.budget, arena=0), users=1)
    arenas._spaces[space.id] = arenas._current[None] = arenas._one = space
    return arenas

  @classmethod
  def of_allocator(cls, allocator: shm.Allocator) -> Arenas:
    """One unmapped arena over ``allocator`` (what ``Leases`` alone needs)."""
    arenas = cls(allocator.size, per_tenant=False)
    arenas.budget = allocator.budget
    space = Space(next(arenas._ids), None, None, allocator, users=1)
    arenas._spaces[space.id] = arenas._current[None] = arenas._one = space
    return arenas

  # ---- which arena ---------------------------------------------------------------------

  def _space(self, tenant: str | None, *, handed: bool = False) -> Space:
    """Where ``tenant``'s new blocks go, made if it has none; the lock is held.

    A name that is no tenant now (removed by a reload) gets the sidecar's own arena for
    blocks the sidecar keeps, but ``handed`` (its fd goes to a process: a Worker's attach,
    a feed's worker processes) it is AuthenticationError: that arena is no tenant's."""
    key = tenant if self.per_tenant else None
    space = self._current.get(key)
    if space is not None and not space.retired:
      return space
    ceiling = None if key is None else self._ceiling_of(key)
    if key is not None and ceiling is None:
      if handed:
        raise errors.AuthenticationError(
            f"tenant {key!r} is not in the pool file now (a reload removed it): its "
            "arena is gone, and no other is handed to it")
      return self._space(None)
    nbytes = min(ceiling or self.size, self.size)
    sid = next(self._ids)
    name = f"sidecar-arena-{key}" if key is not None else "sidecar-arena"
    try:
      arena = self._make(nbytes, name)
    except OSError as e:  # out of descriptors or memory maps: this request fails, not the rest
      raise errors.ResourceExhaustedError(
          f"cannot make the arena of {f'tenant {key!r}' if key is not None else 'the sidecar'} "
          f"({shm.format_size(nbytes)}): {e.strerror or e}; raise the sidecar's descriptor "
          "limit (ulimit -n) or its memory maps (vm.max_map_count)") from e
    space = Space(sid, key, arena, shm.Allocator(
        arena.size if arena is not None else nbytes, budget=self.budget, arena=sid))
    self._spaces[sid] = self._current[key] = space
    log.info("arena %d made for %s: %s", sid, f"tenant {key!r}" if key is not None
             else "the sidecar", shm.format_size(space.size))
    return space

  @contextlib.contextmanager
  def using(self, tenant: str | None = None, *, space: int | None = None) -> Iterator[Space]:
    """The arena ``space`` (an id), else ``tenant``'s, kept open while the block runs."""
    s = self.enter(tenant, space=space)
    try:
      yield s
    finally:
      self.leave(s)

  def enter(self, tenant: str | None, *, space: int | None = None,
            handed: bool = False) -> Space:
    """The arena ``space`` (an id), else ``tenant``'s, kept open until :meth:`leave` (a
    feed's, while it runs; ``handed``: its fd goes to the feed's processes)."""
    if self._one is not None:
      return self._one
    with self._lock:
      s = self._space(tenant, handed=handed) if space is None else self._spaces.get(space)
      if s is None:
        raise errors.InvalidArgumentError(f"arena {space} is closed")
      s.users += 1
      return s

  def leave(self, space: Space) -> None:
    if space is self._one:
      return
    with self._lock:
      space.users -= 1
      self._close_if_idle(space)

  def bind(self, session: str, tenant: str | None) -> Space:
    """The arena a Worker attaching as ``session`` of ``tenant`` is handed, its for as long
    as the session lasts (:meth:`unbind`)."""
    if self._one is not None:
      return self._one
    with self._lock:
      s = self._space(tenant, handed=True)
      s.users += 1
      self._sessions[session] = s
      return s

  def unbind(self, session: str) -> None:
    if self._one is not None:
      return
    with self._lock:
      s = self._sessions.pop(session, None)
      if s is not None:
        s.users -= 1
        self._close_if_idle(s)

  def of_session(self, session: str) -> Space | None:
    """The arena worker ``session`` was handed, None if it is not attached (outside a
    pool: the one arena, whatever the session)."""
    if self._one is not None:
      return self._one
    return self._sessions.get(session)  # one read of a dict: atomic, no lock needed

  def get(self, space: int) -> Space | None:
    """The open arena ``space`` (an id)."""
    if self._one is not None:
      return self._one if space == self._one.id else None
    return self._spaces.get(space)  # one read of a dict: atomic, no lock needed

  def arena(self, space: int) -> shm.Arena:
    """The mapping of arena ``space``, where a live block of it lies."""
    s = self.get(space)
    if s is None or s.arena is None:
      raise errors.InvalidArgumentError(f"arena {space} is not mapped in this sidecar")
    return s.arena

  def current(self, tenant: str | None) -> Space | None:
    """Where ``tenant``'s new blocks go now, if it has an arena (none is made)."""
    if self._one is not None:
      return self._one
    with self._lock:
      s = self._current.get(tenant if self.per_tenant else None)
      return None if s is None or s.retired else s

  # ---- lifetime ------------------------------------------------------------------------

  def retire(self, tenant: str) -> None:
    """Puts no new block of ``tenant`` in its arena (removed, or its token changed): the
    arena closes once its blocks are released and its Workers gone; a tenant of that name
    later gets a new memfd."""
    if not self.per_tenant:
      return
    with self._lock:
      s = self._current.pop(tenant, None)
      if s is not None:
        s.retired = True
        self._close_if_idle(s)

  def refresh(self) -> None:
    """After a reload: an arena smaller than its tenant's ceiling now is retired (a new
    one, of the new size, takes its tenant's next blocks)."""
    if not self.per_tenant:
      return
    with self._lock:
      for key, s in list(self._current.items()):
        if key is None:
          continue
        ceiling = self._ceiling_of(key)
        if ceiling is None or min(ceiling, self.size) > s.size:
          del self._current[key]
          s.retired = True
          self._close_if_idle(s)

  def freed(self, space: int) -> None:
    """A block of arena ``space`` was freed: a retired arena may close now."""
    s = self._spaces.get(space)
    if s is None or not s.retired:  # the usual case, no lock: only a retired one closes
      return
    with self._lock:
      self._close_if_idle(s)

  def _close_if_idle(self, s: Space) -> None:
    """Closes ``s`` if retired with no user and no block; the lock is held."""
    if not s.retired or s.users > 0 or s.allocator.num_blocks or s.closed:
      return
    s.closed = True
    del self._spaces[s.id]
    if s.arena is not None:
      s.arena.punch(0, s.arena.size)  # its pages go, whoever still maps it
      s.arena.close()
    log.info("arena %d of %s closed", s.id, f"tenant {s.tenant!r}" if s.tenant is not None
             else "the sidecar")

  def close(self) -> None:
    """Closes every arena; idempotent."""
    with self._lock:
      spaces, self._spaces = list(self._spaces.values()), {}
      self._current.clear()
      self._sessions.clear()
    for s in spaces:
      s.closed = True
      if s.arena is not None:
        s.arena.close()

  # ---- memory --------------------------------------------------------------------------

  def made(self, block: shm.Block) -> None:
    """``block`` was made: punches free ranges' pages if the pages all arenas may hold,
    with it written, could pass ``--shm-size``.

    What an arena's pages may hold is bounded by its top (no block was made above it
    since its free pages were last punched) or by what they held at the last look (a
    Worker may write outside its blocks), whichever is more. A block below its arena's
    top costs nothing here, not even the lock: a busy pool reuses its arenas' pages. One
    that raises a top looks (the pages measured at most every ``MEASURE_S``), and where the
    bounds together pass the size, whole arenas' free pages are punched, those that keep
    the most first, until they fit: a batch, after which those arenas' next blocks make
    pages again up to the size before anything is punched.
    """
    if not self.per_tenant:
      return  # one arena, reserved whole at start
    s = self._spaces.get(block.arena)  # one read of a dict: atomic, no lock needed
    end = block.offset + block.nbytes
    if s is None or (end <= s.top and time.monotonic() - self._measured < MEASURE_S):
      return
    with self._lock:
      s.top = max(s.top, end)
      spaces = list(self._spaces.values())
      now = time.monotonic()
      if now - self._measured >= MEASURE_S:
        for x in spaces:
          x.measured = x.resident_bytes()
        self._measured = now
      bound = {x: max(x.top, x.measured) for x in spaces}
      total = sum(bound.values())
      # The most kept pages first: they hold the most memory no block uses.
      for x in sorted(spaces, key=lambda x: bound[x] - x.allocator.used_bytes, reverse=True):
        if total <= self.size:
          break
        if x.arena is None or bound[x] <= x.allocator.used_bytes:
          continue
        x.allocator.punch_free(x.arena.punch)
        x.measured, x.top = x.arena.resident_bytes(), x.allocator.top
        total -= bound[x] - max(x.top, x.measured)
        self.punches += 1
        log.debug("arena %d: punched its free pages, %s left", x.id,
                  shm.format_size(x.measured))

  def resident_bytes(self) -> int:
    """The bytes of memory all arenas' pages hold now."""
    with self._lock:
      return sum(s.resident_bytes() for s in self._spaces.values())

  # ---- figures (as one allocator's) ----------------------------------------------------

  @property
  def used_bytes(self) -> int:
    return self.budget.used

  @property
  def num_blocks(self) -> int:
    with self._lock:
      return sum(s.allocator.num_blocks for s in self._spaces.values())

  def fits(self, nbytes: int) -> bool:
    """Whether a block of ``nbytes`` could ever fit (all arenas empty)."""
    return -(-nbytes // shm.ALIGN) * shm.ALIGN <= self.size

  def num_open(self) -> int:
    with self._lock:
      return len(self._spaces)
