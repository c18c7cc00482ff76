"""The kept batches of a sidecar's feeds: what ``feeds/replay.py`` serves again.

A batch a feed made is filed here before it is sent (:meth:`KeptBatches.keep`: a pin of its own
on the batch's arena blocks) under its feed's :class:`FeedKey` (the tenant, the pipeline and
its code, the arguments, the seed, the host's rows and the global batch, the data identity)
and the feed state it follows; a stream opened later at a state whose next batches are
here takes them (:meth:`KeptBatches.open`). What is kept, and for how long:

- from the trainer's save on (:meth:`KeptBatches.saved`): the batches before it go; so do those
  before the state a stream of the same key opens at;
- at most the feed's ``limit`` batches a key (``FeedOptions.replay``), and at most
  :data:`SHARE` of the arena they lie in for all keys together: past either a new batch is
  not kept (those kept are the oldest since the save: the first a rollback re-does);
- they count against the tenant whose feed made them, as any block of its (``leases.py``),
  and give way first where the arena is full (:meth:`KeptBatches.reclaim`, before the RAM tier's
  durable copies): a kept batch never keeps a new one from being made;
- a key no stream has used for :data:`IDLE_S` loses them at the next look.

The store never touches a batch's bytes: its streams take and check them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import crc32c
import numpy as np

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.feeds import producer
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)

# What kept batches may hold of an arena (a pool tenant's, or the sidecar's one), together.
SHARE = 0.25
# A feed key that no stream has used for this long loses its kept batches.
IDLE_S = 300.0
Position = tuple[int, int]  # (epoch, position): a feed state, as a resume names it


def position_of(state: dict[str, Any]) -> Position:
  """The ``(epoch, position)`` of a host's feed state (``FeedSpec.state_json``'s)."""
  return int(state.get("epoch", 0)), int(state.get("position", 0))


def told_position(text: str) -> Position | None:
  """The position of the save a feed's consumer told (``saved_state_json``), None where
  it is no feed state (nothing is dropped for it)."""
  try:
    state = json.loads(text)
    epoch, position = state["epoch"], state["position"]
  except (ValueError, TypeError, KeyError, RecursionError):
    return None
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
             for v in (epoch, position)):
    return None
  return epoch, position


@dataclasses.dataclass(frozen=True, slots=True)
class FeedKey:
  """What a kept batch was made by: another feed serves it only where all of this matches."""
  tenant: str | None
  pipeline: str
  code_hash: str
  kwargs: str  # sha256 of the encoded arguments
  seed: int
  global_batch_size: int
  ranges: tuple[tuple[int, int], ...]
  shard_index: int
  shard_count: int
  num_epochs: int | None
  data: str | None  # the pipeline's data identity, where it names one

  @classmethod
  def of(cls, *, tenant: str | None, pipeline: str, code_hash: str, kwargs: pb.Value,
         spec: producer.Spec, data: str | None) -> FeedKey:
    digest = hashlib.sha256(kwargs.SerializeToString(deterministic=True)).hexdigest()
    return cls(tenant, pipeline, code_hash, digest, spec.seed, spec.global_batch_size,
               spec.ranges, spec.shard_index, spec.shard_count, spec.num_epochs, data)


@dataclasses.dataclass(eq=False, slots=True)
class Kept:
  """One kept batch: its blocks (``refs[leaf][range]`` in arena ``arena``, held by ``pin``),
  the element structure, the feed state it follows (``at``) and the state after it."""
  at: Position
  structure: pb.Value
  refs: tuple[tuple[codec.ArenaRef, ...], ...]
  state: dict[str, Any]
  arena: int
  pin: Hashable
  nbytes: int
  crc: int
  made: float  # monotonic, when it was kept

  def blocks(self) -> Iterator[codec.ArenaRef]:
    for leaf in self.refs:
      yield from leaf


def checksum(arrays: Iterator[np.ndarray]) -> int:
  """crc32c over ``arrays``' bytes, in order."""
  crc = 0
  for a in arrays:
    crc = crc32c.crc32c(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data, crc)
  return crc


class KeptBatches:
  """The kept batches of one sidecar's feeds, by :class:`FeedKey` (see the module).

  Args:
    leases: the holders of the sidecar's arena blocks, where each kept batch holds its own.
    share: what kept batches may hold of an arena, together.
    idle_s: how long a key no stream uses keeps its batches.
  """

  def __init__(self, leases: Leases, *, share: float = SHARE, idle_s: float = IDLE_S,
               clock: Callable[[], float] = time.monotonic):
    self._leases = leases
    self._share, self._idle_s, self._clock = share, idle_s, clock
    self._lock = threading.Lock()
    self._kept: dict[FeedKey, dict[Position, Kept]] = {}  # each oldest first
    self._bytes: dict[int, int] = {}  # by arena
    self._streams: dict[FeedKey, int] = {}  # streams open on each key
    self._used: dict[FeedKey, float] = {}  # when a stream of each key last did anything
    self.served = 0  # batches served again, in all (benchmarks, tests)

  # ---- a stream's ----------------------------------------------------------------------

  def open(self, key: FeedKey, at: Position, *, holder: Hashable, arena: int) -> list[Kept]:
    """A stream of ``key`` opens at ``at``: the kept batches that follow it, one after
    another, each held for ``holder`` (the stream's pin, in ``arena``) so none is freed
    before the stream serves or lets go of it. Those of ``key`` before ``at`` go."""
    with self._lock:
      self._expire()
      self._streams[key] = self._streams.get(key, 0) + 1
      self._used[key] = self._clock()
      self._drop_before(key, at)
      chain: list[Kept] = []
      kept = self._kept.get(key, {})
      while (k := kept.get(at)) is not None and k.arena == arena:
        try:
          for ref in k.blocks():
            self._leases.hold(ref.offset, ref.generation, holder, arena=arena)
        except errors.StaleDescriptorError:  # cannot be while its pin holds: say so, go on
          log.error("a kept batch of feed %r lost its blocks while kept", key.pipeline)
          break
        chain.append(k)
        at = position_of(k.state)
      return chain

  def keep(self, key: FeedKey, at: Position, structure: pb.Value,
           refs: tuple[tuple[codec.ArenaRef, ...], ...], state: dict[str, Any], *,
           arena: int, arena_size: int, crc: int, limit: int) -> bool:
    """Keeps the batch that follows ``at`` (its blocks ``refs`` in ``arena``, not sent
    yet); False where ``limit`` batches of ``key``, or ``SHARE`` of the arena, are kept
    already (the oldest since the save stay), or its blocks are gone."""
    nbytes = kept_bytes(refs)
    with self._lock:
      self._used[key] = self._clock()
      kept = self._kept.setdefault(key, {})
      old = kept.pop(at, None)  # made again (one in the middle went): the new one stays
      if old is not None:
        self._let_go(old)
      if not self._room(key, nbytes, arena=arena, arena_size=arena_size, limit=limit):
        if not kept:
          del self._kept[key]
        return False
      pin = self._leases.new_pin(arena)
      try:
        for leaf in refs:
          for r in leaf:
            self._leases.hold(r.offset, r.generation, pin, arena=arena)
      except errors.StaleDescriptorError:
        self._leases.release_all(pin)
        return False
      kept[at] = Kept(at, structure, refs, state, arena, pin, nbytes, crc, self._clock())
      self._bytes[arena] = self._bytes.get(arena, 0) + nbytes
      return True

  def room(self, key: FeedKey, nbytes: int, *, arena: int, arena_size: int,
           limit: int) -> bool:
    """Whether a batch of ``nbytes`` of ``key`` would be kept now (``keep`` decides)."""
    with self._lock:
      return self._room(key, nbytes, arena=arena, arena_size=arena_size, limit=limit)

  def saved(self, key: FeedKey, at: Position) -> int:
    """The trainer of ``key``'s feed saved at ``at``: the batches before it go; how many."""
    with self._lock:
      return self._drop_before(key, at)

  def corrupt(self, key: FeedKey, k: Kept) -> None:
    """``k`` does not hold what was kept (its trainer wrote into it): it goes."""
    with self._lock:
      kept = self._kept.get(key, {})
      if kept.get(k.at) is k:
        del kept[k.at]
        self._let_go(k)

  def closed(self, key: FeedKey) -> None:
    """A stream of ``key`` ended."""
    with self._lock:
      self._streams[key] -= 1
      if not self._streams[key]:
        del self._streams[key]
      self._used[key] = self._clock()

  # ---- the arena's ---------------------------------------------------------------------

  def reclaim(self, nbytes: int, tenant: str | None = None) -> int:
    """Lets go of kept batches, ``tenant``'s first and each key's newest first, until about
    ``nbytes`` are let go of (their blocks come back once nothing else holds them);
    returns the bytes let go of. ``Leases``' reclaim, before the RAM tier's."""
    if nbytes <= 0:
      return 0
    with self._lock:
      order = sorted(((key, k) for key, kept in self._kept.items() for k in kept.values()),
                     key=lambda pair: (pair[0].tenant != tenant, -pair[1].made))
      gone = 0
      for key, k in order:
        if gone >= nbytes:
          break
        kept = self._kept[key]
        del kept[k.at]
        if not kept:
          del self._kept[key]
        self._let_go(k)
        gone += k.nbytes
    if gone:
      log.info("kept feed batches let go of: %d bytes, for new work%s", gone,
               f" of tenant {tenant!r}" if tenant else "")
    return gone

  def count_served(self) -> None:
    """A stream served one of them again."""
    with self._lock:
      self.served += 1

  def kept_bytes(self) -> int:
    """The bytes kept batches hold now, in all."""
    with self._lock:
      return sum(self._bytes.values())

  def count(self, key: FeedKey | None = None) -> int:
    """Batches kept now (of ``key`` only, if given)."""
    with self._lock:
      if key is not None:
        return len(self._kept.get(key, {}))
      return sum(len(kept) for kept in self._kept.values())

  def positions(self, key: FeedKey | None = None) -> list[Position]:
    """Where the kept batches follow (of ``key`` only, if given), sorted."""
    with self._lock:
      return sorted(p for k, kept in self._kept.items() if key in (None, k) for p in kept)

  def close(self) -> None:
    """Lets go of every kept batch; idempotent."""
    with self._lock:
      for kept in list(self._kept.values()):
        for k in list(kept.values()):
          self._let_go(k)
      self._kept.clear()

  # ---- the lock is held ----------------------------------------------------------------

  def _room(self, key: FeedKey, nbytes: int, *, arena: int, arena_size: int,
            limit: int) -> bool:
    return (len(self._kept.get(key, ())) < limit
            and self._bytes.get(arena, 0) + nbytes <= self._share * arena_size)

  def _drop_before(self, key: FeedKey, at: Position) -> int:
    kept = self._kept.get(key)
    if not kept:
      return 0
    old = [p for p in kept if p < at]
    for p in old:
      self._let_go(kept.pop(p))
    if not kept:
      del self._kept[key]
    return len(old)

  def _let_go(self, k: Kept) -> None:
    self._leases.release_all(k.pin)
    self._bytes[k.arena] -= k.nbytes
    if self._bytes[k.arena] <= 0:
      del self._bytes[k.arena]

  def _expire(self) -> None:
    now = self._clock()
    for key in [key for key in self._kept if key not in self._streams
                and now - self._used.get(key, now) >= self._idle_s]:
      for k in self._kept.pop(key).values():
        self._let_go(k)
      self._used.pop(key, None)


def kept_bytes(refs: Any) -> int:
  """The arena bytes of a batch's blocks ``refs[leaf][range]`` (each a block of its own)."""
  return sum(-(-max(r.nbytes, 1) // shm.ALIGN) * shm.ALIGN for leaf in refs for r in leaf)
