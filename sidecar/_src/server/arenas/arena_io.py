"""The arena side of a call: views of a caller's blocks, results and batches put in blocks.

Ownership, block by block:
- an argument's block is the caller's worker session's; the sidecar's view of it
  pins it (a local holder) until the view dies;
- a result encoded for a worker session is leased to that session, which frees it;
- an array made by ``sidecar.empty`` is pinned while the sidecar holds a view of it;
- a feed batch's arrays (:class:`BatchBlocks`) are leased to the worker session, or
  pinned until the batch is encoded inline.

With a pool file every one of these is in the arena of the caller's tenant
(``arenas.py``): a worker session's own, or for a pin the tenant it is made for.

Views die in whatever thread drops the last reference (a finalizer), so they hand
their block back through a queue that the thread of :class:`ArenaIO` drains: a
finalizer never takes a lock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.core import dtypes as dtypes_lib, errors, trees
from sidecar._src.server.arenas import leases as leases_lib
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.user import outputs
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)

Alive = Callable[[], bool]  # whether the caller is still there
TimeLeft = Callable[[], float | None]  # seconds to its deadline; None without one
# The longest a request waits for room in the arena, deadline or not: a feed that cannot
# get room says so (ResourceExhaustedError, with the sizes) instead of blocking for ever.
ARENA_WAIT_S = 60.0


class ArenaIO:
  """Reads and writes arena blocks on behalf of callers; owns the thread that frees views.

  Args:
    leases: who holds which block of the sidecar's arenas.
    inline_limit: arrays up to this many bytes travel in the message, not the arena.
    is_attached: whether a worker session is attached now.
  """

  def __init__(self, leases: Leases, *, inline_limit: int,
               is_attached: Callable[[str], bool]):
    self.leases = leases
    self._inline_limit = inline_limit
    self.is_attached = is_attached
    # Finalizers of sidecar-side views hand their block back here, never under a lock.
    self._released: queue.SimpleQueue = queue.SimpleQueue()
    self._releaser = threading.Thread(target=self._release_loop, name="sidecar-release",
                                      daemon=True)
    self._releaser.start()

  def alloc(self, nbytes: int, holder: Hashable, alive: Alive, time_left: TimeLeft
            ) -> shm.Block:
    """Allocates, waiting for space while the caller lives and its deadline allows, and
    at most ``ARENA_WAIT_S`` (a feed or stream has no deadline: another client that
    holds the arena would block it for ever).

    Raises:
      ResourceExhaustedError: no room in time, with the sizes asked, free and held.
    """
    first = time_left()
    # Give up a little before the deadline: the error must reach the caller in time.
    margin = 0.0 if first is None else min(0.5, 0.1 + 0.1 * first)
    start = time.monotonic()
    while True:
      left = time_left()  # None without a deadline
      left = ARENA_WAIT_S if left is None else left - margin
      left = min(left, ARENA_WAIT_S - (time.monotonic() - start))
      # A tenant's request waits its turn in the admission queue once (it checks alive
      # itself): a retry would join at the end, behind the tenant's later requests.
      queued = self.leases.queued(holder)
      try:
        block = self.leases.alloc(nbytes, holder, timeout=max(0.0, left if queued else
                                                              min(left, 1.0)), alive=alive)
        return self._to_attached(block, holder)
      except errors.ResourceExhaustedError as e:
        if queued or not self.leases.fits(nbytes, holder) or not alive():
          raise
        if left <= 1.0:
          raise self._no_room(nbytes, holder, time.monotonic() - start, e) from None

  def _to_attached(self, block: shm.Block, holder: Hashable) -> shm.Block:
    """``block``, just leased to ``holder``, if that is a pin or a worker session still
    attached. A session that ended meanwhile (a feed or stream of it still made its next
    item) has had its blocks released (``Workers._serve``: the session leaves first,
    then ``release_all``): nothing would ever release this one, so it goes back now.

    Raises:
      ClosedError: ``holder`` is a worker session that ended.
    """
    if not isinstance(holder, str) or self.is_attached(holder):
      return block  # else: left after the lease; release_all, if not yet run, finds it
    _release_unless_gone(self.leases, block.offset, block.generation, holder)
    raise errors.ClosedError(
        f"worker session {holder} ended while a block of {block.nbytes} bytes was made for "
        "it; its feed or stream ends with it (the trainer that attached it is gone)")

  def _no_room(self, nbytes: int, holder: Hashable, waited: float,
               error: errors.ResourceExhaustedError) -> errors.ResourceExhaustedError:
    if "quota" in str(error):
      return errors.ResourceExhaustedError(f"{error} (waited {waited:.3g} s)")
    a = self.leases.arenas
    by_session, pinned = self.leases.held_bytes()
    mine = by_session.get(holder, 0) if isinstance(holder, str) else 0
    others = sum(by_session.values()) - mine
    fmt = shm.format_size
    ram = self.leases.held_for(holder) or "RAM-tier steps"
    return shm.arena_full(
        nbytes, free=a.size - a.used_bytes, size=a.size, waited=waited,
        holds=f"this caller holds {fmt(mine)}, other worker sessions {fmt(others)}, the sidecar "
        f"itself {fmt(pinned)} (feed batches in flight, staged saves, reads; {ram})",
        advice="free arrays sooner, lower prefetch, give each session a smaller share "
        f"({leases_lib.QUOTA_FLAG})")

  def encode(self, value: Any, session: str, *, alive: Alive, time_left: TimeLeft,
             where: str) -> pb.Value:
    """Encodes a result; its large arrays go to the arena, leased to worker ``session``."""
    if not session:
      return codec.encode(value, inline_limit=self._inline_limit, where=where)
    if not self.is_attached(session):
      raise errors.InvalidArgumentError(
          f"worker_session {session!r} is not attached to this sidecar")
    granted: list[shm.Block] = []
    space = self.leases.space_of(session)  # the arena its worker maps

    def to_arena(a: np.ndarray) -> codec.ArenaRef:
      block = None
      if space is not None and space.arena is not None:
        offset = space.arena.contains(a)
        block = None if offset is None else self.leases.block_at(offset, arena=space.id)
      if block is not None and a.nbytes <= block.nbytes:
        # Already in its arena (a RAM-tier shard, an argument): lease it, copy nothing.
        self.leases.hold(block.offset, block.generation, session, arena=block.arena)
        granted.append(self._to_attached(block, session))
        return codec.ArenaRef(block.offset, a.nbytes, block.generation, a.dtype.name, a.shape)
      block = self.alloc(a.nbytes, session, alive, time_left)
      granted.append(block)
      np.copyto(self.leases.arena_of(block).view(block.offset, a.nbytes),
                a.reshape(-1).view(np.uint8))
      return codec.ArenaRef(block.offset, a.nbytes, block.generation, a.dtype.name, a.shape)

    try:
      return codec.encode(value, to_arena=to_arena, inline_limit=self._inline_limit, where=where)
    except BaseException:
      for block in granted:  # those its session's end released already: gone
        _release_unless_gone(self.leases, block.offset, block.generation, session)
      raise

  def release(self, blocks: list[int], session: str) -> None:
    """Gives back ``session``'s hold on ``blocks`` (flattened (offset, generation) pairs,
    as ``codec.arena_blocks`` lists those of an encoded value)."""
    for offset, generation in zip(blocks[::2], blocks[1::2]):
      self.leases.release(offset, generation, session)

  def allocating(self, alive: Alive, time_left: TimeLeft) -> contextlib.AbstractContextManager:
    """The context user code runs in: ``sidecar.empty`` makes arena arrays, pinned while
    the sidecar holds a view of one; a full arena is waited on while the caller lives and
    its deadline allows."""
    return outputs.allocating(
        lambda shape, dtype: self._empty_array(shape, dtype, alive, time_left))

  def _empty_array(self, shape: tuple[int, ...], dtype: np.dtype, alive: Alive,
                   time_left: TimeLeft) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    block, holder = self.pinned(nbytes, alive, time_left)
    return codec.as_array(holder, codec.ArenaRef(block.offset, nbytes, block.generation,
                                                 dtype.name, shape))

  def pinned(self, nbytes: int, alive: Alive, time_left: TimeLeft
             ) -> tuple[shm.Block, np.ndarray]:
    """A new block of the caller's tenant's arena (``tenants.CURRENT``), pinned while the
    uint8 array returned (or a view of it) lives: ``sidecar.empty``'s, or one a tenant
    process fills."""
    pin = self.leases.new_pin()
    block = self.alloc(max(nbytes, 1), pin, alive, time_left)
    put = self._released.put
    try:
      holder = self.leases.arena_of(block).lease(
          block.offset, max(nbytes, 1), lambda: put((block.offset, block.generation, pin)))
    except BaseException:
      self.leases.release(block.offset, block.generation, pin)
      raise
    return block, holder

  def view(self, ref: codec.ArenaRef, session: str) -> np.ndarray:
    """A sidecar-side array on an arena block, pinned while any view of it lives.

    The block must be held by the caller's worker ``session`` and have room for
    ``ref`` (the codec checked that ``ref`` matches its shape and dtype): a
    caller reads and writes only its own blocks. Nothing is pinned unless all holds.
    """
    if not session or not self.is_attached(session):
      raise errors.InvalidArgumentError(
          f"an arena reference needs the request's worker_session to name the attached "
          f"worker that holds its block, got worker_session {session!r}; without a worker, "
          "send arrays inline")
    pin = self.leases.new_pin()
    block = self.leases.hold_owned(ref.offset, ref.generation, ref.nbytes, owner=session,
                                   holder=pin)
    put = self._released.put
    try:
      holder = self.leases.arena_of(block).lease(ref.offset, ref.nbytes,
                                                 lambda: put((ref.offset, ref.generation, pin)))
    except BaseException:
      self.leases.release(ref.offset, ref.generation, pin)
      raise
    return codec.as_array(holder, ref)

  def close(self) -> None:
    """Stops the thread that hands blocks back (once those queued are back); idempotent."""
    self._released.put(None)
    if self._releaser is not threading.current_thread():
      self._releaser.join(10)

  def _release_loop(self) -> None:
    while True:
      item = self._released.get()
      if item is None:
        return
      offset, generation, pin = item
      try:
        self.leases.release(offset, generation, pin)
      except errors.StaleDescriptorError as e:
        log.error("%s", e)


class BatchBlocks:
  """The arena blocks of one feed's batches, from allocation until they are sent.

  Every batch array is a block of its own: leased to the worker ``session`` (which
  then receives it without a copy), or, with no session, pinned here until the
  batch is encoded inline. ``close`` gives back those made but never sent.

  All are in one arena, kept open until ``close``: the session's, else ``tenant``'s
  (``arena``, which the feed's worker processes map).
  """

  def __init__(self, io: ArenaIO, session: str, alive: Alive, time_left: TimeLeft, *,
               tenant: str | None = None):
    self._io = io
    self._session = session
    self._alive, self._time_left = alive, time_left
    arenas = io.leases.arenas
    bound = arenas.of_session(session) if session else None
    self._space = arenas.enter(tenant, space=None if bound is None else bound.id,
                               handed=True)
    self._entered = True
    if self._space.arena is None:
      self.close()
      raise errors.InvalidArgumentError("a feed's batches need a mapped arena")
    self.arena: shm.Arena = self._space.arena
    # By the id of its array (held here, so the id is its own until sent): each block, its
    # descriptor and its holder. Not by its address: numpy works that out in ~5 us.
    self._placed: dict[int, tuple[shm.Block, codec.ArenaRef, Hashable, np.ndarray]] = {}
    self._fix = ""  # what room one batch needs, once check_batch knows (for a wait's error)

  def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new batch array in a block of its own (``feed.Alloc``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    holder = self._session or self._io.leases.new_pin(self._space.id)
    try:
      block = self._io.alloc(max(nbytes, 1), holder, self._alive, self._time_left)
    except errors.ResourceExhaustedError as e:
      if not self._fix:
        raise
      raise errors.ResourceExhaustedError(f"{e}; {self._fix}") from None
    ref = codec.ArenaRef(block.offset, nbytes, block.generation, dtypes_lib.name_of(dtype),
                         tuple(shape))
    out = codec.as_array(self.arena.view(block.offset, max(nbytes, 1)), ref)
    self._placed[id(out)] = (block, ref, holder, out)
    return out

  def check_batch(self, sizes: list[int], *, name: str, prefetch: int | None) -> None:
    """Refuses at once (ResourceExhaustedError) a feed whose one batch, blocks of
    ``sizes`` bytes, could never be held at once here: more than the arena, or than the
    worker session's quota or its tenant's part. Its leaves may each fit, the batch not:
    waiting for room that never comes would only end at ``ARENA_WAIT_S``. The error
    names the batch's bytes, the arena's and the --shm-size that would fit one batch,
    and about what feeding with ``prefetch`` needs."""
    leases = self._io.leases
    holder = self._session or leases.new_pin(self._space.id)
    total = sum(-(-max(n, 1) // shm.ALIGN) * shm.ALIGN for n in sizes)
    fmt, size = shm.format_size, self.arena.size
    ahead = (prefetch or 1) + 2  # the trainer's batch, those sent ahead, the one being made
    need, loop = leases.shm_size_for(total, holder), leases.shm_size_for(ahead * total, holder)
    if not leases.tenant_limited(holder):
      # Where a batch fits alone, the room may still not come: a trainer (on the CPU, whose
      # arrays are the arena's blocks) that holds its batch while it asks for the next.
      self._fix = (
          f"one batch of feed {name!r} takes {fmt(total)} here; a training loop that holds "
          f"a batch while the next {prefetch or 1} come (prefetch={prefetch or 1}) needs "
          f"about --shm-size {loop} (LocalCluster's shm_size=\"{loop}\"): {ahead} x "
          f"{fmt(total)}")
    if leases.fits(total, holder):
      return
    blocks = f"{len(sizes)} block{'s' if len(sizes) != 1 else ''}"
    one = f"feed {name!r}: one batch of this host's rows takes {fmt(total)} of the arena " \
        f"({blocks}: one per leaf and row range), and can never fit"
    if leases.tenant_limited(holder):  # a pool's tenant: its part, as the pool file sets it
      raise errors.ResourceExhaustedError(
          f"{one}: {leases.never_fits(total, holder)} (one batch needs "
          f"{shm.shm_size_of(total)} of its part)")
    quota = leases.quota if isinstance(holder, str) else None
    limit = (f"the arena is {fmt(size)}" if total > size or quota is None else
             f"a worker session may hold {fmt(quota)} of the {fmt(size)} arena "
             f"(sidecar serve {leases_lib.QUOTA_FLAG})")
    if quota is not None and total <= size and not leases.quota_share:
      raise errors.ResourceExhaustedError(
          f"{one}: {limit}; raise {leases_lib.QUOTA_FLAG} to {shm.shm_size_of(total)} at "
          "least, or make the batch smaller (fewer rows on this host, smaller leaves)")
    raise errors.ResourceExhaustedError(
        f"{one}: {limit}. One batch needs --shm-size {need} (LocalCluster's "
        f"shm_size=\"{need}\"); a training loop that holds a batch while the next "
        f"{prefetch or 1} come (prefetch={prefetch or 1}) needs about --shm-size {loop}: "
        f"{ahead} x {fmt(total)}; or make the batch smaller (fewer rows on this host, "
        "smaller leaves)")

  @property
  def space(self) -> int:
    """The id of the arena its blocks are made in."""
    return self._space.id

  def block_of(self, out: np.ndarray) -> shm.Block:
    """The block of a batch array :meth:`alloc` made and not yet sent."""
    return self._placed[id(out)][0]

  def to_arena(self, a: np.ndarray) -> codec.ArenaRef | None:
    """The descriptor a batch array is sent as (``codec.encode``'s ``to_arena``); None
    (inline) without a session."""
    if not self._session:
      return None  # inline: the bytes are copied into the message
    found = self._placed.get(id(a))
    return None if found is None else found[1]

  @property
  def arena_id(self) -> int:
    """The id of the arena the batches are made in (``arenas.Space.id``)."""
    return self._space.id

  def lease(self, ref: codec.ArenaRef) -> None:
    """Leases a block made before, still held by someone (a feed's kept batch,
    ``feeds/kept.py``), to this feed's worker session, which receives and frees it as
    one of its own.

    Raises:
      ClosedError: the session ended (its blocks were let go of: this one is not held).
    """
    block = self._io.leases.hold(ref.offset, ref.generation, self._session,
                                 arena=self._space.id)
    self._io._to_attached(block, self._session)

  def sent(self, tree: Any) -> None:
    """The blocks of a batch that was encoded: the session's to free now, or, copied
    into the message (no session), unpinned."""
    for leaf in _arrays(tree):
      found = self._placed.pop(id(leaf), None)
      if found is not None and not self._session:
        block, _, holder, _ = found
        self._io.leases.release(block.offset, block.generation, holder)

  def close(self) -> None:
    """Gives back the blocks made but never sent, every one; idempotent. Those of a
    worker session that ended went back at its end already (``Leases.release_all``)."""
    placed, self._placed = self._placed, {}
    for block, _, holder, _ in placed.values():
      _release_unless_gone(self._io.leases, block.offset, block.generation, holder)
    if self._entered:
      self._entered = False
      self._io.leases.arenas.leave(self._space)


def _release_unless_gone(leases: Leases, offset: int, generation: int,
                         holder: Hashable) -> None:
  """Releases ``holder``'s hold on a block, unless it was released already: a worker
  session's blocks go back at its end, and a feed's or stream's teardown that comes later
  must still give back each of the others (StaleDescriptorError would stop it at the
  first)."""
  with contextlib.suppress(errors.StaleDescriptorError):
    leases.release(offset, generation, holder)


def _arrays(tree: Any) -> list[np.ndarray]:
  """The numpy arrays in ``tree``, a value the codec has encoded (core/trees walks it: the
  sidecar starts without JAX)."""
  return [x for x in trees.leaves(tree) if isinstance(x, np.ndarray)]
