"""Re-done steps served the batches their sidecar kept (``FeedOptions(replay=N)``).

A feed stream's batches go through :class:`Replaying` (``feed_batches``): where the feed
keeps batches (``FeedSpec.replay``, a worker session), each batch it makes is filed in the
sidecar's store (``feeds/kept.py``: its blocks held by a pin of the store's, its crc32c
taken) before it is sent; a stream opened at a state whose next batches are kept
(``Feed.seek`` after an in-process rollback, or a restarted trainer's feed at its
checkpoint's data state) serves them again, held for its own session, while its producer
starts on the first batch after them on a thread of its own; then it goes on producing,
keeping as before. The batches are the same bytes the pipeline made: a kept batch whose
crc32c no longer matches (its trainer wrote into it: a torch tensor changed in place) is
made anew, and so is every one after it. The trainer's saves reach the stream with a credit
(``credits.take_saved``) and let go of the batches before them.

Nothing is served across a changed pipeline (name or code), arguments, seed, layout or data
identity: each is part of the key. The kept batches live in this sidecar's arenas: a trainer
killed and restarted beside the same sidecar finds them; a sidecar that restarts has none.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from sidecar._src.server.arenas.arena_io import BatchBlocks
from sidecar._src.server.feeds import producer
from sidecar._src.server.feeds.kept import (
  FeedKey,
  Kept,
  KeptBatches,
  checksum,
  kept_bytes,
  position_of,
  told_position,
)
from sidecar._src.wire import codec
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)

# How long a stream's end waits for its producer's first batch, made on a thread of its own
# while kept batches were served: it ends once the batch is made or the feed's client gone.
WARM_JOIN_S = 120.0

# (batch, state after it, seconds making it, how its arrays are sent)
Made = tuple[producer.Batch, dict[str, Any], float, codec.ToArena]


def feed_batches(store: KeptBatches | None, request: pb.CallRequest, spec: producer.Spec,
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

  def __init__(self, store: KeptBatches, key: FeedKey, spec: producer.Spec,
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
