"""Running registered code for a caller: arguments in, results out, through the arena.

Shared by the two ways in: the gRPC service (controllers anywhere) and the
worker socket (the device-owning process on this host, the fast path).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import jax
import numpy as np

from sidecar._src import codec, errors, protocol, registry as registry_lib, shm
from sidecar._src.host import feed as feed_lib, feed_pool, metrics as metrics_lib, outputs
from sidecar._src.host.credits import CreditSource
from sidecar._src.host.leases import Leases
from sidecar._src.protocol import pb

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "sidecar."
Alive = Callable[[], bool]
TimeLeft = Callable[[], float | None]


class Runner:
  """Decodes calls, runs registered functions, encodes results into the arena."""

  def __init__(self, *, registry: registry_lib.Registry, arena: shm.Arena, leases: Leases,
               inline_limit: int, is_attached: Callable[[str], bool],
               imports: tuple[str, ...] = (),
               builtins: dict[str, Callable[..., Any]] | None = None,
               metrics: metrics_lib.Recorder = metrics_lib.OFF):
    self.registry = registry
    self._metrics = metrics
    # The sidecar's own functions (``sidecar.*``), run like registered ones.
    self._builtins = registry_lib.Registry()
    for name, fn in (builtins or {}).items():
      self._builtins.add(registry_lib.FUNCTION, name, fn)
    self._imports = imports
    self._arena = arena
    self._leases = leases
    self._inline_limit = inline_limit
    self._is_attached = is_attached
    self._lock = threading.Lock()
    self.calls = 0
    self._feed_status: dict[int, tuple[pb.FeedStatus, float, Any]] = {}
    # Per pipeline, the feeds that ended: [feeds, batches, produce, backpressure, wait].
    self._feed_totals: dict[str, list[float]] = {}
    # Finalizers of sidecar-side views hand their block back here, never under a lock.
    self._released: queue.SimpleQueue = queue.SimpleQueue()
    self._releaser = threading.Thread(target=self._release_loop, name="sidecar-release",
                                      daemon=True)
    self._releaser.start()

  def prepare(self, request: pb.CallRequest, kind: str = registry_lib.FUNCTION
              ) -> tuple[registry_lib.Entry, tuple, dict]:
    """The registered entry and decoded, signature-checked arguments of a call."""
    if kind == registry_lib.FUNCTION and request.name.startswith(BUILTIN_PREFIX):
      entry = self._builtins.get(kind, request.name)
    else:
      entry = self.registry.get(kind, request.name)
    view = lambda ref: self._view(ref, request.worker_session)
    budget = codec.Budget()  # one for the request: what it costs to decode is what it sent
    args = codec.decode(request.args, from_arena=view, where="args", budget=budget)
    kwargs = codec.decode(request.kwargs, from_arena=view, where="kwargs", budget=budget)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(
        isinstance(k, str) for k in kwargs):
      raise errors.InvalidArgumentError(
          f"args must be a tuple and kwargs a dict with str keys, got {type(args).__name__} "
          f"and {type(kwargs).__name__}")
    if entry.signature is not None:
      try:
        entry.signature.bind(*((None,) if kind == registry_lib.PIPELINE else ()), *args,
                             **kwargs)
      except TypeError as e:
        raise errors.InvalidArgumentError(
            f"bad arguments for {entry.kind} {entry.name!r}{entry.signature}: {e}") from None
    with self._lock:
      self.calls += 1
    return entry, args, kwargs

  def label(self, kind: str, name: str) -> str:
    """``name`` if it is registered (the metrics' label), else ``<unregistered>``."""
    if kind == registry_lib.FUNCTION and name.startswith(BUILTIN_PREFIX):
      return name if self._builtins.has(kind, name) else metrics_lib.UNREGISTERED
    return name if self.registry.has(kind, name) else metrics_lib.UNREGISTERED

  def call(self, request: pb.CallRequest, *, alive: Alive, time_left: TimeLeft) -> pb.Value:
    if not self._metrics.enabled:
      return self._call(request, alive=alive, time_left=time_left)
    self._metrics.call_started("call")
    t0, code = time.perf_counter(), "OK"
    try:
      return self._call(request, alive=alive, time_left=time_left)
    except BaseException as e:
      code = protocol.status_code(e).name
      raise
    finally:
      self._metrics.call_done("call", self.label(registry_lib.FUNCTION, request.name), code,
                              time.perf_counter() - t0)

  def _call(self, request: pb.CallRequest, *, alive: Alive, time_left: TimeLeft) -> pb.Value:
    entry, args, kwargs = self.prepare(request)
    with outputs.allocating(self._empty(alive, time_left)):
      result = entry.fn(*args, **kwargs)
    return self.encode(result, request.worker_session, alive=alive, time_left=time_left,
                       where=f"result of {request.name!r}")

  def stream(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
             time_left: TimeLeft) -> Iterator[pb.StreamItem]:
    """Items of a registered iterable, each produced only once a credit allows it."""
    items: Generator[pb.StreamItem, None, None] = self._stream(
        request, credits, alive=alive, time_left=time_left)
    if not self._metrics.enabled:
      yield from items
      return
    feed = request.HasField("feed")
    kind = "feed" if feed else "stream"
    self._metrics.call_started(kind)
    t0, code = time.perf_counter(), "OK"
    try:
      yield from items
    except GeneratorExit:  # the consumer went away mid-stream
      code = "CANCELLED"
      raise
    except BaseException as e:
      code = protocol.status_code(e).name
      raise
    finally:
      items.close()
      self._metrics.call_done(kind, self.label(
          registry_lib.PIPELINE if feed else registry_lib.FUNCTION, request.name), code,
          time.perf_counter() - t0)

  def _stream(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
              time_left: TimeLeft) -> Generator[pb.StreamItem, None, None]:
    if request.HasField("feed"):
      yield from self._feed(request, credits, alive=alive, time_left=time_left)
      return
    entry, args, kwargs = self.prepare(request)
    with outputs.allocating(self._empty(alive, time_left)):
      items = entry.fn(*args, **kwargs)
    try:
      iterator = iter(items)
    except TypeError:
      raise errors.InvalidArgumentError(
          f"function {request.name!r} returned {type(items).__name__}, not an iterable; "
          "streams need a function that returns an iterable (a generator, say)") from None
    index = 0
    try:
      while credits.take():
        try:
          with outputs.allocating(self._empty(alive, time_left)):
            item = next(iterator)
        except StopIteration:
          return
        yield pb.StreamItem(index=index, value=self.encode(
            item, request.worker_session, alive=alive, time_left=time_left,
            where=f"item {index} of {request.name!r}"))
        index += 1
    finally:
      close = getattr(iterator, "close", None)
      if close is not None:
        close()

  def _feed(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
            time_left: TimeLeft) -> Iterator[pb.StreamItem]:
    """This host's batches of a feed, written straight into arena blocks."""
    entry, args, kwargs = self.prepare(request, registry_lib.PIPELINE)
    if args:
      raise errors.InvalidArgumentError(
          f"pipeline {request.name!r} takes keyword arguments only, got {len(args)} positional")
    spec = feed_lib.Spec.from_proto(request.feed)
    session = request.worker_session
    if session and not self._is_attached(session):
      raise errors.InvalidArgumentError(f"worker_session {session!r} is not attached")
    # Every batch array is an arena block: leased to the worker session (which then
    # receives it without a copy), or pinned here until the batch is encoded inline.
    placed: dict[int, tuple[shm.Block, codec.ArenaRef, Any]] = {}

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
      nbytes = math.prod(shape) * dtype.itemsize
      holder = session or self._leases.new_pin()
      block = self._alloc(max(nbytes, 1), holder, alive, time_left)
      ref = codec.ArenaRef(block.offset, nbytes, block.generation, dtype.name, tuple(shape))
      out = codec.as_array(self._arena.view(block.offset, max(nbytes, 1)), ref)
      placed[out.ctypes.data] = (block, ref, holder)
      return out

    def to_arena(a: np.ndarray) -> codec.ArenaRef | None:
      if not session:
        return None  # inline: the bytes are copied into the message
      found = placed.pop(a.ctypes.data, None)
      return None if found is None else found[1]

    def pool() -> feed_pool.Pool:
      return feed_pool.Pool(spec.workers, arena=self._arena, imports=self._imports,
                            name=request.name, kwargs=request.kwargs, spec=request.feed)

    batches = feed_lib.produce(entry, kwargs, spec, alloc, pool)
    index = 0
    status = pb.FeedStatus(pipeline=request.name, workers=spec.workers)
    started = time.perf_counter()
    with self._lock:
      self._feed_status[id(status)] = (status, started, credits)
    try:
      while True:
        t0 = time.perf_counter()
        if not credits.take():
          return
        status.backpressure_s += time.perf_counter() - t0
        try:
          tree, state, seconds = next(batches)
        except StopIteration:
          return
        status.batches += 1
        status.produce_s += seconds
        value = codec.encode({"batch": tree, "state": state, "produce_s": seconds},
                             to_arena=to_arena, inline_limit=0,
                             where=f"batch {index} of pipeline {request.name!r}")
        if not session:
          self._release_placed(placed, tree)
        yield pb.StreamItem(index=index, value=value)
        index += 1
    finally:
      with self._lock:
        self._feed_status.pop(id(status), None)
        totals = self._feed_totals.setdefault(request.name, [0, 0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, status.batches, status.produce_s, status.backpressure_s,
                               credits.consumer_wait_s)):
          totals[i] += v
      batches.close()
      for block, _, holder in placed.values():  # made but never sent
        self._leases.release(block.offset, block.generation, holder)

  def feeds(self) -> list[pb.FeedStatus]:
    """A snapshot of every running feed on this sidecar."""
    with self._lock:
      running = list(self._feed_status.values())
    out = []
    for status, started, credits in running:
      snap = pb.FeedStatus()
      snap.CopyFrom(status)
      snap.uptime_s = time.perf_counter() - started
      snap.trainer_wait_s = credits.consumer_wait_s
      out.append(snap)
    return out

  def feed_totals(self) -> tuple[metrics_lib.FeedTotals, ...]:
    """Per pipeline, its feeds' figures so far: those running and those that ended."""
    with self._lock:  # one lock: a feed that ends now is counted once, either way
      totals = {name: list(t) for name, t in self._feed_totals.items()}
      running = [(status.pipeline, status.batches, status.produce_s, status.backpressure_s,
                  credits.consumer_wait_s) for status, _, credits in self._feed_status.values()]
    count: dict[str, int] = {}
    for name, *figures in running:
      t = totals.setdefault(name, [0, 0, 0.0, 0.0, 0.0])
      for i, v in enumerate(figures, 1):
        t[i] += v
      count[name] = count.get(name, 0) + 1
    return tuple(metrics_lib.FeedTotals(name, count.get(name, 0), int(t[1]), t[2], t[3], t[4])
                 for name, t in sorted(totals.items()))

  def _release_placed(self, placed: dict, tree: Any) -> None:
    """Unpins the blocks of an inline-encoded batch."""
    for leaf in jax.tree_util.tree_leaves(tree):
      block, _, holder = placed.pop(leaf.ctypes.data)
      self._leases.release(block.offset, block.generation, holder)

  def encode(self, value: Any, session: str, *, alive: Alive, time_left: TimeLeft,
             where: str) -> pb.Value:
    """Encodes a result; its large arrays go to the arena, leased to worker ``session``."""
    if not session:
      return codec.encode(value, inline_limit=self._inline_limit, where=where)
    if not self._is_attached(session):
      raise errors.InvalidArgumentError(
          f"worker_session {session!r} is not attached to this sidecar")
    granted: list[shm.Block] = []

    def to_arena(a: np.ndarray) -> codec.ArenaRef:
      offset = self._arena.contains(a)
      block = None if offset is None else self._leases.block_at(offset)
      if block is not None and a.nbytes <= block.nbytes:
        # Already in the arena (a RAM-tier shard, an argument): lease it, copy nothing.
        self._leases.hold(block.offset, block.generation, session)
        granted.append(block)
        return codec.ArenaRef(block.offset, a.nbytes, block.generation, a.dtype.name, a.shape)
      block = self._alloc(a.nbytes, session, alive, time_left)
      granted.append(block)
      np.copyto(self._arena.view(block.offset, a.nbytes), a.reshape(-1).view(np.uint8))
      return codec.ArenaRef(block.offset, a.nbytes, block.generation, a.dtype.name, a.shape)

    try:
      return codec.encode(value, to_arena=to_arena, inline_limit=self._inline_limit, where=where)
    except BaseException:
      for block in granted:
        self._leases.release(block.offset, block.generation, session)
      raise

  def _alloc(self, nbytes: int, holder: Any, alive: Alive, time_left: TimeLeft) -> shm.Block:
    """Allocates, waiting for space while the caller lives and its deadline allows."""
    first = time_left()
    # Give up a little before the deadline: the error must reach the caller in time.
    margin = 0.0 if first is None else min(0.5, 0.1 + 0.1 * first)
    while True:
      left = time_left()  # None without a deadline
      if left is not None:
        left -= margin
      try:
        return self._leases.alloc(
            nbytes, holder, timeout=1.0 if left is None else max(0.0, min(left, 1.0)))
      except errors.ResourceExhaustedError:
        if not self._leases.allocator.fits(nbytes) or not alive() or (
            left is not None and left <= 1.0):
          raise

  def _empty(self, alive: Alive, time_left: TimeLeft) -> outputs.Allocate:
    """``sidecar.empty`` for a call: arena arrays, pinned while the sidecar holds a view
    of one; a full arena is waited on while the caller lives and its deadline allows."""
    return lambda shape, dtype: self._empty_array(shape, dtype, alive, time_left)

  def _empty_array(self, shape: tuple[int, ...], dtype: np.dtype, alive: Alive,
                   time_left: TimeLeft) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    pin = self._leases.new_pin()
    block = self._alloc(max(nbytes, 1), pin, alive, time_left)
    put = self._released.put
    holder = self._arena.lease(block.offset, max(nbytes, 1),
                               lambda: put((block.offset, block.generation, pin)))
    return codec.as_array(holder, codec.ArenaRef(block.offset, nbytes, block.generation,
                                                 dtype.name, shape))

  def _view(self, ref: codec.ArenaRef, session: str) -> np.ndarray:
    """A sidecar-side array on an arena block, pinned while any view of it lives.

    The block must be held by the caller's worker ``session`` and have room for
    ``ref`` (the codec checked that ``ref`` agrees with its shape and dtype): a
    caller reads and writes only its own blocks. Nothing is pinned unless all holds.
    """
    if not session or not self._is_attached(session):
      raise errors.InvalidArgumentError(
          f"an arena reference needs the request's worker_session to name the attached "
          f"worker that holds its block, got worker_session {session!r}; without a worker, "
          "send arrays inline")
    pin = self._leases.new_pin()
    self._leases.hold_owned(ref.offset, ref.generation, ref.nbytes, owner=session, holder=pin)
    put = self._released.put
    try:
      holder = self._arena.lease(ref.offset, ref.nbytes,
                                 lambda: put((ref.offset, ref.generation, pin)))
    except BaseException:
      self._leases.release(ref.offset, ref.generation, pin)
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
        self._leases.release(offset, generation, pin)
      except errors.StaleDescriptorError as e:
        log.error("%s", e)

