"""Streams: a registered iterable's items, or a feed's batches, each made once a credit allows.

Both ways in (the gRPC service and the worker socket) hand :meth:`StreamRunner.run`
a start request and a :class:`~sidecar._src.server.calls.credits.CreditSource`; what comes
back is the stream of ``pb.StreamItem``s to send. A feed is a stream whose request
carries a ``FeedSpec``: its batches are written straight into arena blocks
(``arena_io.BatchBlocks``), and its figures are kept in a :class:`FeedBook`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Generator, Iterator

from sidecar._src.core import errors
from sidecar._src.server import client_log, isolation, metrics as metrics_lib
from sidecar._src.server.arenas.arena_io import Alive, BatchBlocks, TimeLeft
from sidecar._src.server.calls.calls import Runner, measured
from sidecar._src.server.calls.credits import CreditSource
from sidecar._src.server.feeds import (
  idle as idle_lib,
  kept as kept_lib,
  processes as feed_processes,
  producer,
  replay as replay_lib,
)
from sidecar._src.server.pool import shares as shares_lib
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.user import registry as registry_lib
from sidecar._src.wire import codec, feed_batch, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
Items = Generator[pb.StreamItem, None, None]


class StreamRunner:
  """Runs streams and feeds with the functions, pipelines and arena of a :class:`Runner`.

  Args:
    runner: what decodes and checks a stream's arguments.
    imports: the modules a feed's worker processes import (the sidecar's own).
    replay: the feeds' kept batches (``feeds/kept.py``); None: none are kept.
    idle: the feeds' worker processes kept idle between two streams of the same work
      (``feeds/idle.py``); None: a feed's workers stop with it.
  """

  def __init__(self, runner: Runner, *, imports: tuple[str, ...] = (),
               tenancy: tenants_lib.Tenancy | None = None,
               replay: kept_lib.KeptBatches | None = None,
               idle: idle_lib.IdleWorkers | None = None):
    self._runner = runner
    self._replay = replay
    self._io = runner.arena_io
    self._imports = imports
    self._book = FeedBook()
    self._tenancy = tenancy or tenants_lib.Tenancy(None)
    self._idle = idle or idle_lib.IdleWorkers(self._tenancy, grace=0)
    # A pool's tenants with feeds share the feed workers' CPUs by weight (shares.py).
    self._shares = shares_lib.Shares(producer.MAX_WORKERS)  # the CPUs this sidecar may use

  def run(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
          time_left: TimeLeft, tenant: str | None = None) -> Iterator[pb.StreamItem]:
    """Items of a registered iterable (or a feed's batches), each made only once a credit
    allows it. ``tenant``: whose stream it is (its allowlists and feed quotas hold).

    Raises:
      PermissionDeniedError: ``tenant``'s allowlist does not hold the name.
      ResourceExhaustedError: ``tenant`` runs as many feeds or feed workers as it may.
    """
    feed = request.HasField("feed")
    self._tenancy.check_allowed(tenant, registry_lib.PIPELINE if feed
                                else registry_lib.FUNCTION, request.name)
    self._tenancy.check_worker(tenant, request.worker_session)
    items: Items = _reported((self._feed if feed else self._stream)(
        request, credits, alive=alive, time_left=time_left, tenant=tenant), request, tenant)
    if tenant is not None:
      items = self._unless_revoked(items, tenant)
    if not self._runner.metrics.enabled:
      yield from items
      return
    label = self._runner.label(registry_lib.PIPELINE if feed else registry_lib.FUNCTION,
                               request.name)
    with measured(self._runner.metrics, "feed" if feed else "stream", label):
      yield from items  # closes items when this generator is closed

  def _unless_revoked(self, items: Items, tenant: str) -> Items:
    """``items``, ended (AuthenticationError, naming why) at the first item after a reload
    revoked ``tenant``: a removed tenant's streams and feeds stop with its sessions."""
    revoked = self._tenancy.revoked
    try:
      for item in items:
        if tenant in revoked:
          raise errors.AuthenticationError(f"{revoked[tenant]}; its stream was ended")
        yield item
    except errors.SidecarError:
      if tenant in revoked:  # its process was stopped with it, say: the reason is the reload
        raise errors.AuthenticationError(f"{revoked[tenant]}; its stream was ended") from None
      raise
    finally:
      items.close()

  def feeds(self, tenant: str | None = None) -> list[pb.FeedStatus]:
    """A snapshot of every running feed on this sidecar (of ``tenant`` only, if named)."""
    return self._book.running(tenant)

  def kept_bytes(self) -> int:
    """The arena bytes of feed batches kept for re-done steps (``feeds/kept.py``)."""
    return 0 if self._replay is None else self._replay.kept_bytes()

  def tenant_batches(self) -> dict[str, int]:
    """Per tenant, the batches its feeds made here (running and ended)."""
    return self._book.tenant_batches()

  def feed_totals(self) -> tuple[metrics_lib.FeedTotals, ...]:
    """Per pipeline, its feeds' figures so far: those running and those that ended."""
    return self._book.totals()

  def _stream(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
              time_left: TimeLeft, tenant: str | None) -> Items:
    work = self._runner.isolation.work_of(tenant)
    if work is not None:
      yield from self._stream_elsewhere(work, request, credits, alive=alive,
                                        time_left=time_left)
      return
    entry, args, kwargs = self._runner.prepare(request)
    # Its arrays made in place (sidecar.empty) are its tenant's: in its arena.
    with self._io.allocating(alive, time_left), tenants_lib.acting_as(tenant):
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
          with self._io.allocating(alive, time_left), tenants_lib.acting_as(tenant):
            item = next(iterator)
        except StopIteration:
          return
        yield pb.StreamItem(index=index, value=self._io.encode(
            item, request.worker_session, alive=alive, time_left=time_left,
            where=f"item {index} of {request.name!r}"))
        index += 1
    finally:
      close = getattr(iterator, "close", None)
      if close is not None:
        close()

  def _stream_elsewhere(self, work: isolation.TenantWork, request: pb.CallRequest,
                        credits: CreditSource, *, alive: Alive, time_left: TimeLeft) -> Items:
    """A stream whose iterable runs in its tenant's process: an item made there at each
    credit here."""
    values = work.stream(self._runner.admit(request), request, alive=alive,
                         time_left=time_left)
    try:
      index = 0
      while credits.take():
        value = next(values, None)
        if value is None:
          return
        yield pb.StreamItem(index=index, value=value)
        index += 1
    finally:
      values.close()

  def _feed(self, request: pb.CallRequest, credits: CreditSource, *, alive: Alive,
            time_left: TimeLeft, tenant: str | None) -> Items:
    """This host's batches of a feed, written straight into arena blocks (by its tenant's
    process, in a pool: its pipeline runs there)."""
    work = self._runner.isolation.work_of(tenant)
    entry: registry_lib.Entry
    if work is None:
      entry, args, kwargs = self._runner.prepare(request, registry_lib.PIPELINE)
      if args:
        raise errors.InvalidArgumentError(
            f"pipeline {request.name!r} takes keyword arguments only, got {len(args)} "
            "positional")
    else:  # its arguments are decoded (and its pipeline run) in its tenant's process
      entry, kwargs = self._runner.admit(request, registry_lib.PIPELINE), {}
    spec = producer.Spec.from_proto(request.feed)
    roots = self._tenancy.data_roots(tenant)  # in a pool, its files only beneath these
    if spec.length_only:
      if credits.take():
        length = (producer.length(entry, kwargs, spec, roots, alive) if work is None
                  else work.length(entry, request, roots=roots, alive=alive))
        yield pb.StreamItem(batch=pb.FeedBatch(structure=codec.encode(None),
                                               state_json=json.dumps({"length": length})))
      return
    session = request.worker_session
    if session and not self._io.is_attached(session):
      raise errors.InvalidArgumentError(f"worker_session {session!r} is not attached")
    blocks = BatchBlocks(self._io, session, alive, time_left, tenant=tenant)
    t = self._tenancy.tenant(tenant) if self._tenancy.quotas else None
    turns = None if t is None else self._shares.turns(t.name, t.weight)
    # The pipeline's data identity (checked against the state the feed resumes from): part
    # of the key of its kept batches and of its idle workers.
    data = functools.cache(lambda: producer.data_identity(entry, kwargs, spec, roots, alive))
    lease: idle_lib.Lease | None = None

    def make_workers() -> contextlib.AbstractContextManager[feed_processes.FeedProcesses]:
      def start() -> feed_processes.FeedProcesses:
        return feed_processes.FeedProcesses(
            spec.workers, arena=blocks.arena, imports=self._imports, name=request.name,
            kwargs=request.kwargs, spec=request.feed, turns=turns, alive=alive, roots=roots)
      if lease is None:
        return start()
      return lease.workers(start, size=spec.workers, turns=turns, alive=alive)

    check = functools.partial(blocks.check_batch, name=request.name,
                              prefetch=credits.prefetch)
    def produce(spec: producer.Spec):
      if work is not None:  # made in its tenant's process, its workers started here for it
        return work.feed(entry, request, blocks=blocks, check=check, turns=turns,
                         roots=roots, alive=alive)
      return producer.produce(entry, kwargs, spec, blocks.alloc, make_workers, check, roots,
                              alive)

    # Batches kept since the trainer's last save first, where this feed's are kept; workers
    # left idle by the last stream of the same work, where there are. A pool tenant's
    # pipeline runs in its own process, which alone decodes its arguments and knows its
    # data identity: its feeds keep no batches and adopt no idle workers (yet).
    try:
      if spec.workers and work is None:
        key = kept_lib.FeedKey.of(tenant=tenant, pipeline=entry.name,
                                  code_hash=entry.code_hash, kwargs=request.kwargs, spec=spec,
                                  data=data())
        lease = self._idle.lease(idle_lib.WorkKey.of(key, roots=roots, arena=blocks.arena_id),
                                 session=session)
      batches = replay_lib.feed_batches(
          self._replay if work is None else None, request, spec, produce, entry=entry,
          kwargs=kwargs, blocks=blocks, tenant=tenant, told=credits.take_saved, data=data)
    except BaseException:
      if lease is not None:
        lease.close()
      blocks.close()
      raise
    status = pb.FeedStatus(pipeline=request.name, workers=spec.workers)
    try:
      with self._idle.feeding(tenant, spec.workers), self._book.feeding(
          status, credits, tenant), turns or contextlib.nullcontext():
        index = 0
        while True:
          t0 = time.perf_counter()
          if not credits.take():
            return
          status.backpressure_s += time.perf_counter() - t0
          try:
            batch, state, seconds, to_arena = next(batches)
          except StopIteration:
            return
          status.batches += 1
          status.produce_s += seconds
          value = feed_batch.encode(batch.structure, batch.leaves, state, seconds,
                                    to_arena=to_arena,
                                    where=f"batch {index} of pipeline {request.name!r}")
          blocks.sent(batch.leaves)
          yield pb.StreamItem(index=index, batch=value)
          index += 1
    finally:
      batches.close()
      if lease is not None:
        lease.close()
      blocks.close()


def _reported(items: Items, request: pb.CallRequest, tenant: str | None) -> Items:
  """``items``, where user code's error (its pipeline's or iterable's, raised while it is
  built or at any item) is logged here at ERROR with its traceback, and raised as the
  RemoteError that crosses to the trainer as it is. Our own errors pass unchanged: a
  user's FileNotFoundError must never look like a closed socket (``workers.py``)."""
  try:
    yield from items
  except errors.ClosedError as e:
    # Its trainer went (its session ended while a batch was made for it): nothing went
    # wrong here, and nobody is left to tell; a line, no traceback (a feed closed as its
    # workers make batches does this at every close).
    _log_failure(request, e, tenant, logging.INFO, traceback=False)
    raise
  except errors.SidecarError as e:
    # A feed worker's (a RemoteError, with its own traceback) and ours about the pipeline
    # (a path not found beneath its data roots, say: the trainer's PipelineError) at
    # ERROR, as PipelineError says; another of ours (a quota) at WARNING.
    pipelines = isinstance(e, errors.RemoteError) or errors.PipelineError.of(
        e, request.name, host_id=None) is not None
    _log_failure(request, e, tenant, logging.ERROR if pipelines else logging.WARNING)
    raise
  except Exception as e:
    _log_failure(request, e, tenant)
    raise protocol.remote_error(e) from e


def _log_failure(request: pb.CallRequest, e: Exception, tenant: str | None,
                 level: int = logging.ERROR, *, traceback: bool = True) -> None:
  what = (f"pipeline {request.name!r} (a feed)" if request.HasField("feed")
          else f"stream {request.name!r}")
  who = "" if tenant is None else f" of tenant {tenant!r}"
  kind, message = ((e.remote_type, e.remote_message) if isinstance(e, errors.RemoteError)
                   else (type(e).__name__, str(e)))
  session = request.worker_session
  client_log.DEFAULT.log(
      log, level, f"tenant {tenant!r}" if tenant else f"worker session {session}",
      "%s%s raised %s: %s; its trainer is told, and this sidecar serves on", what, who, kind,
      protocol.for_log(message), exc_info=e if traceback else None,
      extra={"session": session} if session else None)


class FeedBook:
  """The figures of a sidecar's feeds: each running one's, and per pipeline those ended."""

  def __init__(self):
    self._lock = threading.Lock()
    self._running: dict[int, tuple[pb.FeedStatus, float, CreditSource, str | None]] = {}
    # Per pipeline, the feeds that ended: [feeds, batches, produce, backpressure, wait].
    self._ended: dict[str, list[float]] = {}
    self._ended_batches: dict[str, int] = {}  # per tenant, batches of its feeds that ended

  @contextlib.contextmanager
  def feeding(self, status: pb.FeedStatus, credits: CreditSource,
              tenant: str | None = None) -> Iterator[None]:
    """Counts ``status`` (which the feed updates) as running while the context lasts."""
    with self._lock:
      self._running[id(status)] = (status, time.perf_counter(), credits, tenant)
    try:
      yield
    finally:
      with self._lock:
        self._running.pop(id(status), None)
        totals = self._ended.setdefault(status.pipeline, [0, 0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, status.batches, status.produce_s, status.backpressure_s,
                               credits.consumer_wait_s)):
          totals[i] += v
        if tenant is not None:
          self._ended_batches[tenant] = self._ended_batches.get(tenant, 0) + status.batches

  def tenant_batches(self) -> dict[str, int]:
    """Per tenant, the batches its feeds made (those running and those that ended)."""
    with self._lock:
      out = dict(self._ended_batches)
      for status, _, _, tenant in self._running.values():
        if tenant is not None:
          out[tenant] = out.get(tenant, 0) + status.batches
    return out

  def running(self, tenant: str | None = None) -> list[pb.FeedStatus]:
    """A snapshot of every running feed (of ``tenant`` only, if named)."""
    with self._lock:
      running = [r for r in self._running.values() if tenant is None or r[3] == tenant]
    out = []
    for status, started, credits, _ in running:
      snap = pb.FeedStatus()
      snap.CopyFrom(status)
      snap.uptime_s = time.perf_counter() - started
      snap.trainer_wait_s = credits.consumer_wait_s
      out.append(snap)
    return out

  def totals(self) -> tuple[metrics_lib.FeedTotals, ...]:
    """Per pipeline, its feeds' figures so far: those running and those that ended."""
    with self._lock:  # one lock: a feed that ends now is counted once, either way
      totals = {name: list(t) for name, t in self._ended.items()}
      running = [(status.pipeline, status.batches, status.produce_s, status.backpressure_s,
                  credits.consumer_wait_s) for status, _, credits, _ in self._running.values()]
    count: dict[str, int] = {}
    for name, *figures in running:
      t = totals.setdefault(name, [0, 0, 0.0, 0.0, 0.0])
      for i, v in enumerate(figures, 1):
        t[i] += v
      count[name] = count.get(name, 0) + 1
    return tuple(metrics_lib.FeedTotals(name, count.get(name, 0), int(t[1]), t[2], t[3], t[4])
                 for name, t in sorted(totals.items()))
