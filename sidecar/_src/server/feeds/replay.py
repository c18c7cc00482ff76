"""Kept batches: a feed's batches made since its trainer's last save, served again when a
rollback or a restart re-does their steps (``FeedOptions(replay=N)``, ``FeedSpec.replay``).

A batch a feed makes is already in arena blocks, leased to the trainer's worker session.
:class:`Replay` adds a hold of its own on those blocks (a pin per batch) before the batch
is sent, so the blocks outlive the trainer's use of them, and files the batch under the
feed's :class:`FeedKey` (its tenant, pipeline and code, arguments, seed, layout and data
identity) and the feed state it follows. A feed opened later at a state whose next
batches are kept (``Feed.seek`` after an in-process rollback, or a restarted trainer's
feed at its checkpoint's data state) serves them from there, held for its own session,
while its producer starts on the first batch after them (:class:`Replaying`); then it
goes on producing, keeping as before. The batches are the same bytes the pipeline made:
each kept batch's crc32c is taken before it is sent and checked before it is served
again, so one its trainer wrote into (a torch tensor changed in place) is made anew.

What is kept, and for how long:

- from the trainer's save on: its feed tells the sidecar the feed state it saved
  (``StreamRequest.saved_state_json``, sent with a credit), and the batches before it go;
  so do those before the state a feed of the same key opens at;
- at most ``FeedSpec.replay`` batches a feed key, and at most ``SHARE`` of the arena they
  lie in for all keys together: past either, a new batch is not kept (those kept are the
  oldest since the save: the first a rollback re-does, served while the producer warms up);
- they count against the tenant whose feed made them, as any block of its (``leases.py``),
  and give way first where the arena is full (:meth:`Replay.reclaim`, before the RAM
  tier's durable copies): a kept batch never keeps a new one from being made;
- a key no feed has streamed for ``IDLE_S`` loses them at the next look.

Nothing is replayed across a changed pipeline (name or code), arguments, seed, layout (the
host's rows, the global batch size, the sharding) or data identity: each is part of the
key. Only a feed delivered through the arena (a worker session) keeps batches. The kept
batches live in this sidecar's arenas: a trainer killed and restarted beside the same
sidecar finds them; a sidecar that restarts has none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Generator, Hashable, Iterator
from typing import Any

import crc32c
import numpy as np

from sidecar._src.arena import shm
from sidecar._src.core import errors
from sidecar._src.server.arenas.arena_io import BatchBlocks
from sidecar._src.server.arenas.leases import Leases
from sidecar._src.server.feeds import producer
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)

# What kept batches may hold of an arena (a pool tenant's, or the sidecar's one), together.
SHARE = 0.25
# A feed key that no stream has used for this long loses its kept batches.
IDLE_S = 300.0
# How long a stream's end waits for its producer's first batch, made on a thread of its own
# while kept batches were served: it ends once the batch is made or the feed's client gone.
WARM_JOIN_S = 120.0

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
  """What a kept batch was made by: another feed serves it only where all of this agrees."""
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


class Replay:
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


# (batch, state after it, seconds making it, how its arrays are sent)
Made = tuple[producer.Batch, dict[str, Any], float, codec.ToArena]


def feed_batches(store: Replay | None, request: pb.CallRequest, spec: producer.Spec,
                 produce: Callable[[producer.Spec], Generator[Any, None, None]], *,
                 entry: Any, kwargs: dict, blocks: BatchBlocks, tenant: str | None,
                 data: Callable[[], str | None], told: Callable[[], str]
                 ) -> Replaying | Generator[Made, None, None]:
  """A feed stream's batches (:data:`Made`; ``close()`` ends them): :class:`Replaying`
  where the feed keeps batches (``request.feed.replay``, a worker session, a store),
  else ``produce(spec)``'s as they come. ``data()``: the pipeline's data identity (its
  check against the state the feed resumes from raises here, as the producer's would)."""
  limit = request.feed.replay
  if store is None or not limit or not request.worker_session:
    return _plain(produce(spec), blocks)
  key = FeedKey.of(tenant=tenant, pipeline=entry.name, code_hash=entry.code_hash,
                   kwargs=request.kwargs, spec=spec, data=data())
  return Replaying(store, key, spec, produce, limit=limit, blocks=blocks,
                   session=request.worker_session, told=told)


def _plain(produced: Generator[Any, None, None], blocks: BatchBlocks
           ) -> Generator[Made, None, None]:
  try:
    for batch, state, seconds in produced:
      yield batch, state, seconds, blocks.to_arena
  finally:
    produced.close()


def kept_bytes(refs: Any) -> int:
  """The arena bytes of a batch's blocks ``refs[leaf][range]`` (each a block of its own)."""
  return sum(-(-max(r.nbytes, 1) // shm.ALIGN) * shm.ALIGN for leaf in refs for r in leaf)


class Replaying:
  """One feed stream's batches: the kept ones that follow its start, then ``produce``'s,
  each kept before it is sent. An iterator of :data:`Made`; :meth:`close` ends it.

  From the first kept batch served on, the producer makes its first batch (and, with
  worker processes, starts them and fills the batches in flight) on a thread of this
  object's, so the first batch after the kept ones is ready when they run out.

  Args:
    store: the sidecar's kept batches.
    key: this feed's.
    spec: its host spec (``spec.start``: where it opens).
    limit: how many batches of this feed's key may be kept (``FeedSpec.replay``).
    produce: the producer of this feed from a start state (``producer.produce``'s
      generator for ``spec`` with that start).
    blocks: the feed's arena blocks (its session's arena).
    session: the worker session the batches go to.
    told: the trainer's latest save's feed state, when its consumer told one ("" else).
  """

  def __init__(self, store: Replay, key: FeedKey, spec: producer.Spec,
               produce: Callable[[producer.Spec], Generator[Any, None, None]], *,
               limit: int, blocks: BatchBlocks, session: str, told: Callable[[], str]):
    self._store, self._key, self._limit = store, key, limit
    self._blocks, self._session, self._told = blocks, session, told
    self._leases = store._leases
    self._arena = blocks.arena_id
    self._pin = self._leases.new_pin(self._arena)  # the chain's, until each is served
    self._at = position_of(spec.start)
    self._warm: _Warm | None = None
    self._closed = False
    self._chain = store.open(key, self._at, holder=self._pin, arena=self._arena)
    try:
      self._chain = self._checked(self._chain)
      start = spec.start
      if self._chain:
        start = {**spec.start, **self._chain[-1].state}
        log.info("feed %r opens at %s with %d kept batches to serve again", key.pipeline,
                 self._at, len(self._chain))
      self._produced = produce(dataclasses.replace(spec, start=start))
    except BaseException:
      self._leases.release_all(self._pin)
      store.closed(key)
      raise

  def _checked(self, chain: list[Kept]) -> list[Kept]:
    """``chain`` up to its first batch whose bytes are not those kept (let go of)."""
    arena = self._leases.arenas.arena(self._arena) if chain else None
    for i, k in enumerate(chain):
      assert arena is not None
      if checksum(_views(arena, k)) != k.crc:
        log.warning("feed %r: kept batch at %s was written into since it was sent (its "
                    "trainer changed its arrays in place); it and those after it are made "
                    "anew", self._key.pipeline, k.at)
        self._store.corrupt(self._key, k)
        for later in chain[i:]:
          for ref in later.blocks():
            self._leases.release(ref.offset, ref.generation, self._pin)
        return chain[:i]
    return chain

  def __iter__(self) -> Replaying:
    return self

  def __next__(self) -> Made:
    told = self._told()
    if told and (at := told_position(told)) is not None:
      self._store.saved(self._key, at)
    if self._chain:
      if self._warm is None:  # the first batch asked for (within the feed's quotas)
        self._warm = _Warm(self._produced)
      return self._serve(self._chain.pop(0))
    if self._warm is not None:
      warm, self._warm = self._warm, None
      batch, state, seconds = warm.result()
    else:
      batch, state, seconds = next(self._produced)
    self._keep(batch, state)
    return batch, state, seconds, self._blocks.to_arena

  def _serve(self, k: Kept) -> Made:
    arena = self._leases.arenas.arena(self._arena)
    for ref in k.blocks():  # the session's now; the chain's hold goes
      self._blocks.lease(ref)
      self._leases.release(ref.offset, ref.generation, self._pin)
    views = [[codec.as_array(arena.view(r.offset, max(r.nbytes, 1)), r) for r in leaf]
             for leaf in k.refs]
    refs = {views[i][j].ctypes.data: k.refs[i][j]
            for i in range(len(views)) for j in range(len(views[i]))}
    self._at = position_of(k.state)
    self._store.count_served()
    return (producer.Batch(k.structure, views), k.state, 0.0,
            lambda a: refs.get(a.ctypes.data))

  def _keep(self, batch: producer.Batch, state: dict[str, Any]) -> None:
    at, self._at = self._at, position_of(state)
    refs = tuple(tuple(self._blocks.to_arena(a) for a in leaf) for leaf in batch.leaves)
    if any(r is None for leaf in refs for r in leaf):
      return
    size = self._blocks.arena.size
    if not self._store.room(self._key, kept_bytes(refs), arena=self._arena, arena_size=size,
                            limit=self._limit):
      return  # no checksum taken for a batch that would not be kept
    crc = checksum(a for leaf in batch.leaves for a in leaf)
    self._store.keep(self._key, at, batch.structure, refs, state,  # type: ignore[arg-type]
                     arena=self._arena, arena_size=size, crc=crc, limit=self._limit)

  def close(self) -> None:
    """Ends the stream: its producer's thread joined, its producer closed, the kept
    batches it did not serve let go of (they stay kept); idempotent."""
    if self._closed:
      return
    self._closed = True
    try:
      if self._warm is not None and not self._warm.join(WARM_JOIN_S):
        log.error("feed %r: its producer's first batch was not made %g s after the stream "
                  "ended; left to end on its own", self._key.pipeline, WARM_JOIN_S)
        return
      self._produced.close()
    finally:
      self._chain = []
      self._leases.release_all(self._pin)
      self._store.closed(self._key)


def _views(arena: Any, k: Kept) -> Iterator[np.ndarray]:
  for ref in k.blocks():
    yield codec.as_array(arena.view(ref.offset, max(ref.nbytes, 1)), ref)


class _Warm:
  """The producer's first batch, made on a thread of its own (joined by its owner)."""

  def __init__(self, produced: Generator[Any, None, None]):
    self._produced = produced
    self._out: Any = None
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="sidecar-feed-warm", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    try:
      self._out = next(self._produced)
    except BaseException as e:  # StopIteration too: raised where the stream asks
      self._error = e

  def join(self, timeout: float | None = None) -> bool:
    self._thread.join(timeout)
    return not self._thread.is_alive()

  def result(self) -> Any:
    self._thread.join()
    if self._error is not None:
      error, self._error = self._error, None
      raise error.with_traceback(error.__traceback__)
    return self._out
