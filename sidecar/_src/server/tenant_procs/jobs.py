"""The sidecar's side of a tenant process's jobs: a call, a stream, a feed (its batches or
its length), a read. Each is a :class:`Job` on a socketpair of its own.

What the tenant process asks while a job runs, the sidecar decides, as it would for the
work in its own process: an argument's reference must name a block the caller's worker
session holds (``ArenaIO.view``'s check), a result's block is allocated and leased to that
session here (its tenant's quotas and admission queue), a feed's blocks are its
``BatchBlocks``', a lease names only a block the job was given. What it answers is checked
before it goes on: the blocks a response, an item or a batch names must be the job's, and
its sizes within the request's. A malformed message ends the process (it was not ours any
more); a job whose caller left is closed, which the process sees (``child_jobs.Asker.alive``).
"""

from __future__ import annotations

import contextlib
import math
import select
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt.records import ShardRecord
from sidecar._src.core import errors
from sidecar._src.server.arenas.arena_io import Alive, ArenaIO, BatchBlocks, TimeLeft
from sidecar._src.server.feeds import processes as feed_processes, producer
from sidecar._src.server.pool import shares as shares_lib
from sidecar._src.server.tenant_procs import messages as m
from sidecar._src.server.tenant_procs.process import TenantProcess
from sidecar._src.user import data_roots, registry as registry_lib
from sidecar._src.wire import codec, ipc, protocol
from sidecar._src.wire.protocol import pb

# How often a job that waits for its process asks whether its caller still waits.
ALIVE_EVERY = 0.1
# What a tenant process asks while a job runs (answered by ``Job._grant``).
QUESTIONS: tuple[type[m.Message], ...] = (m.View, m.Alloc, m.Lease, m.Check, m.StartWorkers,
                                          m.StopWorkers, m.Free, m.Submit, m.Wait)
# The bytes of a feed batch's structure, of a stream's item with its arrays in the arena.
SMALL_MAX = ipc.MAX_MESSAGE * 16


class Job:
  """One job of a tenant process, the sidecar's side; a context manager (closing it gives
  back what the job was given and never handed on).

  Args:
    proc: the tenant's process (running).
    arena_io: the sidecar's arenas' blocks.
    session: the request's worker session ("" for none): whose blocks it may view, and to
      whom its results' blocks are leased.
    alive, time_left: whether its caller still waits, and how long it may.
    blocks, check, workers: a feed's blocks, its check of a batch's sizes, and how its
      worker processes are started (``feeds/processes.FeedProcesses``, as many as its
      request asked, each held to the tenant's limits and user).
  """

  def __init__(self, proc: TenantProcess, arena_io: ArenaIO, *, session: str, alive: Alive,
               time_left: TimeLeft, blocks: BatchBlocks | None = None,
               check: Callable[[list[int]], None] | None = None,
               workers: Callable[[], feed_processes.FeedProcesses] | None = None):
    self._proc, self._io, self._session = proc, arena_io, session
    self._alive, self._time_left = alive, time_left
    self._blocks, self._check, self._make_workers = blocks, check, workers
    self._workers: feed_processes.FeedProcesses | None = None
    self._tickets: set[tuple[int, int]] = set()  # batches sent to its workers, not waited
    self.who = f"tenant {proc.tenant!r}'s process (pid {proc.pid})"
    self._pins: list[np.ndarray] = []  # views and pinned blocks: held while the job lives
    self._given: dict[tuple[int, int], shm.Block] = {}  # (arena, offset): what it may lease
    self._leased: dict[tuple[int, int], shm.Block] = {}  # leased to the session, not yet out
    self._made: dict[int, np.ndarray] = {}  # a feed's batch arrays by offset, not yet sent
    self._reads: dict[tuple[int, int], np.ndarray] = {}  # a read's pinned block, by place
    self._sock = proc.open_job()

  # ---- talking to the process ---------------------------------------------------------------

  def send(self, message: m.Message, payload: Any = None) -> None:
    try:
      m.send(self._sock, message, payload)
    except OSError:
      raise self._ended() from None

  def wait(self, expect: tuple[type[m.Message], ...], *, payload_limit: int = 0
           ) -> tuple[m.Message, bytearray | None]:
    """Answers what the process asks until it sends one of ``expect``; returns it and its
    bytes.

    Raises:
      the process's error for the job (typed); the error of its death (a limit named);
      DeadlineExceededError / ClosedError: the caller left or ran out of time.
    """
    while True:
      self._readable()
      try:
        message, payload, _ = m.recv(self._sock, (*expect, *QUESTIONS, m.Error),
                                     payload_limit=payload_limit, what=self.who)
      except (ConnectionError, OSError):
        raise self._ended() from None
      except errors.ResourceExhaustedError:
        raise  # an answer past the request's bound: the job ends, the process serves on
      except errors.InvalidArgumentError as e:  # not our child's any more: it goes
        self._proc.kill()
        raise errors.InvalidArgumentError(f"{e}; the process was stopped") from None
      if isinstance(message, m.Error):
        raise protocol.error_from_dict(message.error, host=self.who)
      if isinstance(message, expect):
        return message, payload
      self._answer(message)

  def _readable(self) -> None:
    """Returns once the job's socket has something to read; raises once its caller left."""
    poller = select.poll()
    poller.register(self._sock, select.POLLIN | select.POLLHUP)
    while not poller.poll(ALIVE_EVERY * 1000):
      if not self._alive():
        raise errors.ClosedError(f"the caller of {self.who}'s job left; the job is ended")
      left = self._time_left()
      if left is not None and left <= 0:
        raise errors.DeadlineExceededError(f"{self.who} did not answer within the caller's "
                                           "deadline; the job is ended")

  def _ended(self) -> errors.SidecarError:
    """What a job that ended without its answer stands for: its process's death (the
    limit it met, its signal: its sockets end a moment before it does), or a job the
    process left unanswered."""
    return self._proc.death()

  # ---- what the process asks ----------------------------------------------------------------

  def _answer(self, question: m.Message) -> None:
    try:
      granted = self._grant(question)
    except errors.SidecarError as e:  # refused: its user code sees why
      self.send(m.Refused(protocol.error_dict(e)))
    else:
      self.send(granted)

  def _hand(self, space: int) -> None:
    found = self._io.leases.arenas.get(space)
    if found is None or found.arena is None:
      raise errors.InvalidArgumentError(f"arena {space} is not mapped in this sidecar")
    self._proc.hand_arena(space, found.arena)

  def _grant(self, q: m.Message) -> m.Message:
    leases = self._io.leases
    if isinstance(q, m.View):
      ref = codec.ArenaRef(q.offset, q.nbytes, q.generation, "uint8", (q.nbytes,))
      self._pins.append(self._io.view(ref, self._session))  # the session's block, pinned
      space = leases.space_of(self._session)
      assert space is not None  # view() checked the session is attached
      block = leases.block_at(q.offset, arena=space.id)
      assert block is not None
      self._hand(space.id)
      self._given[(space.id, q.offset)] = block
      return m.Granted(space.id, q.offset, q.generation)
    if isinstance(q, m.Alloc):
      return self._alloc(q)
    if isinstance(q, m.Lease):
      block = self._given.get((q.arena, q.offset))
      if not self._session or block is None or q.nbytes > block.nbytes:
        raise errors.InvalidArgumentError(
            f"{self.who} asked to lease a block it was not given (arena {q.arena}, offset "
            f"{q.offset}, {q.nbytes} bytes)")
      leases.hold(block.offset, block.generation, self._session, arena=q.arena)
      self._leased[(block.offset, block.generation)] = block
      return m.Granted(q.arena, q.offset, block.generation)
    if isinstance(q, m.Check):
      if self._check is None:
        raise errors.InvalidArgumentError(f"{self.who} checked a batch of no feed")
      self._check(list(q.sizes))
      return m.Granted()
    return self._feed_workers(q)

  def _feed_workers(self, q: m.Message) -> m.Message:
    """A feed's worker processes: started and run here, each held to its tenant's
    limits and user; the tenant process says which batch goes into which blocks."""
    if isinstance(q, m.StartWorkers):
      if self._make_workers is None or self._workers is not None:
        raise errors.InvalidArgumentError(f"{self.who} asked for feed workers it may not start")
      self._workers = self._make_workers()
      return m.Granted()
    workers = self._workers
    if workers is None:
      raise errors.InvalidArgumentError(f"{self.who} asked its feed workers before it "
                                        "started them")
    if isinstance(q, m.StopWorkers):
      self._workers = None
      workers.close()
      return m.Granted()
    if isinstance(q, m.Free):
      return m.Granted(free=workers.free())
    if isinstance(q, m.Submit):
      ticket = workers.submit((q.epoch, q.position), self._unsent(q.leaves))
      self._tickets.add(ticket)
      return m.Ticket(*ticket)
    assert isinstance(q, m.Wait)
    if (q.worker, q.seq) not in self._tickets:
      raise errors.InvalidArgumentError(f"{self.who} waited for a batch it never sent")
    self._tickets.discard((q.worker, q.seq))
    return m.Waited(workers.wait((q.worker, q.seq)))

  def _alloc(self, q: m.Alloc) -> m.Granted:
    if q.use == "batch":
      if self._blocks is None:
        raise errors.InvalidArgumentError(f"{self.who} asked for a batch block of no feed")
      dtype = codec.dtype_of(q.dtype, "a batch's leaf")
      out = self._blocks.alloc(q.shape, dtype)
      if out.nbytes != q.nbytes:
        self._blocks.sent([out])  # not a batch's: given back with its feed
        raise errors.InvalidArgumentError(f"{self.who} asked for a batch block of "
                                          f"{q.nbytes} bytes for shape {q.shape}")
      block = self._blocks.block_of(out)
      self._made[block.offset] = out
      space = self._blocks.space
    elif q.use == "result":
      if not self._session:
        raise errors.InvalidArgumentError(f"{self.who} asked for a result block of a call "
                                          "with no worker session")
      block = self._io.alloc(max(q.nbytes, 1), self._session, self._alive, self._time_left)
      self._leased[(block.offset, block.generation)] = block
      space = block.arena
    else:  # "empty", "read": the tenant's arena, pinned while the job (or its view) lives
      block, holder = self._io.pinned(q.nbytes, self._alive, self._time_left)
      self._pins.append(holder)
      space = block.arena
      if q.use == "read":
        self._reads[(space, block.offset)] = holder
    self._hand(space)
    self._given[(space, block.offset)] = block
    return m.Granted(space, block.offset, block.generation)

  # ---- what the process answers ---------------------------------------------------------

  def handed_on(self, value: pb.Value) -> None:
    """Checks that the blocks ``value`` (a result, an item) names are blocks this job leased
    to its session, and hands them on: the session's now, the job's no more.

    Raises:
      InvalidArgumentError: a block the job was not given (the process is stopped).
    """
    blocks = codec.arena_blocks(value)
    for offset, generation in zip(blocks[::2], blocks[1::2]):
      if self._leased.pop((offset, generation), None) is None:
        self._proc.kill()
        raise errors.InvalidArgumentError(
            f"{self.who} answered with an arena block it was not given (offset {offset}); "
            "the process was stopped")

  def _unsent(self, leaves: tuple[tuple[int, ...], ...]) -> list[list[np.ndarray]]:
    """A batch's arrays, by the offsets of blocks this job made for batches, not sent."""
    try:
      return [[self._made[offset] for offset in leaf] for leaf in leaves]
    except KeyError as e:
      raise errors.InvalidArgumentError(
          f"{self.who} named a block not made for a batch (offset {e})") from None

  def batch_arrays(self, leaves: tuple[tuple[int, ...], ...]) -> list[list[np.ndarray]]:
    """A batch's arrays, by the offsets of the blocks this job made for it (unsent): sent
    now, the job's no more."""
    try:
      arrays = self._unsent(leaves)
    except errors.InvalidArgumentError as e:
      self._proc.kill()
      raise errors.InvalidArgumentError(f"{e}; the process was stopped") from None
    for leaf in leaves:
      for offset in leaf:
        self._made.pop(offset, None)
    return arrays

  def read_block(self, message: m.Data, record: ShardRecord) -> np.ndarray:
    """The shard a read job put in the block it was given (``Alloc`` for a read), as an
    array of its record's form, pinned while it lives.

    Raises:
      InvalidArgumentError: no such block of the job's (the process is stopped).
    """
    holder = self._reads.get((message.arena, message.offset))
    nbytes = math.prod(record.shape) * np.dtype(record.dtype).itemsize if record.dtype else 0
    if holder is None or nbytes > holder.nbytes:
      self._proc.kill()
      raise errors.InvalidArgumentError(
          f"{self.who} answered a read with a block it was not given (arena "
          f"{message.arena}, offset {message.offset}); the process was stopped")
    return codec.as_array(holder, codec.ArenaRef(message.offset, nbytes, 0, record.dtype,
                                                 record.shape))

  def close(self) -> None:
    """Ends the job: its feed workers stopped, its socket closed, its pins let go, the
    blocks it leased and never handed on given back."""
    if self._workers is not None:
      self._workers.close()  # the turns its batches in flight took go back with them
      self._workers = None
    self._sock.close()
    self._pins.clear()  # their finalizers give the pins back
    for block in self._leased.values():
      with contextlib.suppress(errors.StaleDescriptorError):
        self._io.leases.release(block.offset, block.generation, self._session)
    self._leased.clear()
    self._proc.job_closed()

  def __enter__(self) -> Job:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


class Work:
  """One pool tenant's work, run in its process (``isolation.TenantWork``).

  Args:
    process: the tenant's process, started (or started anew) as it is asked for.
    arena_io: the sidecar's arenas' blocks.
    inline_limit: arrays up to this many bytes travel in a message, not the arena.
    limit: the most bytes of a response or an item (the sidecar's max_message_size).
  """

  def __init__(self, process: Callable[[], TenantProcess], arena_io: ArenaIO, *,
               inline_limit: int, limit: int, imports: tuple[str, ...]):
    self._process = process
    self._io = arena_io
    self._inline_limit = inline_limit
    self._limit = limit
    self._imports = imports

  def call(self, entry: registry_lib.Entry, raw: bytes | bytearray, *, session: str,
           alive: Alive, time_left: TimeLeft, splice: bool) -> bytearray:
    """A unary call's serialized CallResponse, its request ``raw`` (a serialized
    CallRequest) decoded and run in the tenant's process; its result's blocks (with a
    worker ``session``) checked to be the job's."""
    with Job(self._process(), self._io, session=session, alive=alive,
             time_left=time_left) as job:
      job.send(m.CallJob(entry.name, entry.code_hash, len(raw), splice, self._inline_limit),
               raw)
      _, payload = job.wait((m.Response,), payload_limit=self._limit)
      payload = payload if payload is not None else bytearray()
      if session:
        job.handed_on(codec.parse(pb.CallResponse, payload).result)
      return payload

  def stream(self, entry: registry_lib.Entry, request: pb.CallRequest, *, alive: Alive,
             time_left: TimeLeft) -> Generator[pb.Value, None, None]:
    """A stream's items, each made once asked for (``next``), its blocks checked."""
    raw = request.SerializeToString()
    with Job(self._process(), self._io, session=request.worker_session, alive=alive,
             time_left=time_left) as job:
      job.send(m.StreamJob(entry.name, entry.code_hash, len(raw), self._inline_limit), raw)
      del raw
      while True:
        job.send(m.Next())
        message, payload = job.wait((m.Item, m.End), payload_limit=self._limit)
        if isinstance(message, m.End):
          return
        value = codec.parse(pb.Value, payload or b"")
        job.handed_on(value)
        yield value

  def feed(self, entry: registry_lib.Entry, request: pb.CallRequest, *,
           blocks: BatchBlocks, check: Callable[[list[int]], None],
           turns: shares_lib.Turns | None, roots: data_roots.DataRoots, alive: Alive
           ) -> Generator[tuple[producer.Batch, dict[str, Any], float], None, None]:
    """A feed's batches, as ``producer.produce`` yields them, made in the tenant's
    process into the blocks of ``blocks``; each made once asked for (``next``)."""
    proc = self._process()
    raw = request.SerializeToString()

    def workers() -> feed_processes.FeedProcesses:
      return feed_processes.FeedProcesses(
          producer.Spec.from_proto(request.feed).workers, arena=blocks.arena,
          imports=self._imports, name=request.name, kwargs=request.kwargs,
          spec=request.feed, turns=turns, alive=alive, roots=roots, launch=proc.launch())

    with Job(proc, self._io, session=request.worker_session, alive=alive,
             time_left=lambda: None, blocks=blocks, check=check, workers=workers) as job:
      job._hand(blocks.space)
      job.send(m.FeedJob(entry.name, entry.code_hash, len(raw), roots.to_dict(), False,
                         blocks.space), raw)
      del raw
      while True:
        job.send(m.Next())
        message, payload = job.wait((m.Batch, m.End), payload_limit=SMALL_MAX)
        if isinstance(message, m.End):
          return
        assert isinstance(message, m.Batch)
        structure = codec.parse(pb.Value, payload or b"")
        leaves = job.batch_arrays(message.leaves)
        yield producer.Batch(structure, leaves), message.state, message.seconds

  def read(self, final_dir: str, record: ShardRecord, *, session: str, checked: bool,
           alive: Alive, time_left: TimeLeft) -> np.ndarray:
    """A checkpoint shard read from storage in the tenant's process, as its user
    (``read.read_stored``): into a block pinned here (worker ``session``, which the caller
    then leases it to), else its bytes back (inline: the caller holds them as its inline
    bytes; so too a record with no dtype, an earlier release's, whose size only the read
    finds: the caller copies them into a block)."""
    into_block = bool(session) and bool(record.dtype)
    with Job(self._process(), self._io, session=session, alive=alive,
             time_left=time_left) as job:
      job.send(m.ReadJob(final_dir, record.to_dict(), into_block, checked))
      message, payload = job.wait((m.Data,), payload_limit=self._limit)
      assert isinstance(message, m.Data)
      if into_block:
        return job.read_block(message, record)
      data = np.frombuffer(payload or b"", np.uint8)
      if not record.dtype:  # a DCP bytes item: its bytes as they are
        return data
      try:
        return data.view(np.dtype(record.dtype)).reshape(record.shape)
      except (TypeError, ValueError):
        raise errors.InvalidArgumentError(
            f"{job.who} answered a read of {data.nbytes} bytes, not a shard of "
            f"{record.dtype}{list(record.shape)}") from None

  def length(self, entry: registry_lib.Entry, request: pb.CallRequest, *,
             roots: data_roots.DataRoots, alive: Alive) -> int | None:
    """A feed's length in global batches (``producer.length``), in the tenant's process."""
    raw = request.SerializeToString()
    with Job(self._process(), self._io, session=request.worker_session, alive=alive,
             time_left=lambda: None) as job:
      job.send(m.FeedJob(entry.name, entry.code_hash, len(raw), roots.to_dict(), True, 0),
               raw)
      job.send(m.Next())
      message, _ = job.wait((m.Length,))
      assert isinstance(message, m.Length)
      return message.length

