"""A tenant process's side of its jobs: a call, a stream, a feed, a read (``child.py`` runs
each in a thread of its own, on the job's socket).

The job's arena blocks are the sidecar's to give: an argument's reference is checked and
pinned there (``View``), a result's block or a batch's allocated there (``Alloc``), an
argument returned leased there (``Lease``); this process only maps its tenant's memfds
and writes into the blocks it was given. What its user code raises goes back as the job's
``Error`` (``limits.ProcessLimits.typed``: a limit the kernel held it to, named).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import select
import socket
import threading
from collections.abc import Iterator
from typing import TypeVar

import numpy as np

from sidecar._src.arena import shm
from sidecar._src.ckptfmt import records
from sidecar._src.core import errors
from sidecar._src.server.calls import calls as calls_lib
from sidecar._src.server.checkpoint import read as checkpoint_read
from sidecar._src.server.feeds import producer
from sidecar._src.server.tenant_procs import limits as limits_lib, messages as m
from sidecar._src.user import data_roots, outputs, registry as registry_lib
from sidecar._src.wire import codec, pbscan, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
A = TypeVar("A", bound=m.Message)
# The most bytes of one request the sidecar sends a job (its max_message_size is at most
# this).
REQUEST_MAX = m.PAYLOAD_MAX


# How long a job waits for an arena the sidecar handed over the control socket: it comes
# before the job's answer that names it, on another socket, read by another thread.
HANDED_S = 10.0


class Arenas:
  """This process's mappings of its tenant's arenas, by the sidecar's ids: added by the
  control socket's thread (``child.py``), read by the jobs' threads."""

  def __init__(self) -> None:
    self._cond = threading.Condition()
    self._by_id: dict[int, shm.Arena] = {}

  def add(self, arena_id: int, arena: shm.Arena) -> None:
    with self._cond:
      self._by_id[arena_id] = arena
      self._cond.notify_all()

  def get(self, arena_id: int) -> shm.Arena:
    """Arena ``arena_id``, once mapped (the sidecar sends its memfd before any answer
    names it).

    Raises:
      InvalidArgumentError: never handed to this process.
    """
    with self._cond:
      if not self._cond.wait_for(lambda: arena_id in self._by_id, timeout=HANDED_S):
        raise errors.InvalidArgumentError(f"arena {arena_id} was never handed to this process")
      return self._by_id[arena_id]

  def items(self) -> list[tuple[int, shm.Arena]]:
    with self._cond:
      return list(self._by_id.items())


class Asker:
  """What a job asks the sidecar for, one question at a time, each answered: blocks to
  view, make and lease, a batch's check, turns at the feed workers.

  Args:
    sock: the job's socket.
    arenas: this process's mappings of its tenant's arenas.
  """

  def __init__(self, sock: socket.socket, arenas: Arenas):
    self.sock = sock
    self._arenas = arenas
    # The blocks this job was given (arena, offset) -> bytes: what it may lease.
    self._given: dict[tuple[int, int], int] = {}

  def ask(self, question: m.Message, answer: type[A] = m.Granted) -> A:  # type: ignore[assignment]
    """The sidecar's ``answer`` to ``question``; what it refused, raised."""
    m.send(self.sock, question)
    got, _, _ = m.recv(self.sock, (answer, m.Refused), what="the sidecar")
    if isinstance(got, m.Refused):
      raise protocol.error_from_dict(got.error, host="the sidecar")
    assert isinstance(got, answer)
    return got

  def arena(self, arena: int) -> shm.Arena:
    return self._arenas.get(arena)

  def _block(self, granted: m.Granted, nbytes: int) -> np.ndarray:
    self._given[(granted.arena, granted.offset)] = nbytes
    return self.arena(granted.arena).view(granted.offset, max(nbytes, 1))

  def view(self, ref: codec.ArenaRef) -> np.ndarray:
    """An argument's array, once the sidecar checked the caller's session holds it."""
    granted = self.ask(m.View(ref.offset, ref.generation, ref.nbytes))
    return codec.as_array(self._block(granted, ref.nbytes), ref)

  def alloc(self, nbytes: int, use: str, shape: tuple[int, ...] = (), dtype: str = ""
            ) -> tuple[m.Granted, np.ndarray]:
    """A new block of ``nbytes`` for ``use`` (``messages.USES``), and its bytes."""
    granted = self.ask(m.Alloc(nbytes, use, tuple(shape), dtype))
    return granted, self._block(granted, nbytes)

  def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``sidecar.empty``'s array: a block of the tenant's arena, pinned for the job."""
    nbytes = math.prod(shape) * dtype.itemsize
    granted, block = self.alloc(nbytes, "empty")
    return codec.as_array(block, codec.ArenaRef(granted.offset, nbytes, granted.generation,
                                                dtype.name, tuple(shape)))

  def batch_array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A feed batch's array (``producer.Alloc``), in a block of the feed's."""
    nbytes = math.prod(shape) * dtype.itemsize
    granted, block = self.alloc(nbytes, "batch", shape, dtype.name)
    return codec.as_array(block, codec.ArenaRef(granted.offset, nbytes, granted.generation,
                                                dtype.name, tuple(shape)))

  def to_arena(self, a: np.ndarray) -> codec.ArenaRef:
    """A result array's reference for the caller's worker session (``codec.encode``'s
    ``to_arena``): the block it lies in, leased as it is, where it is one this job was
    given; else a new block, the array copied into it."""
    for arena_id, arena in self._arenas.items():  # a snapshot: those mapped now
      offset = arena.contains(a)
      have = self._given.get((arena_id, offset)) if offset is not None else None
      if have is not None and offset is not None and a.nbytes <= have:
        granted = self.ask(m.Lease(arena_id, offset, a.nbytes))
        return codec.ArenaRef(offset, a.nbytes, granted.generation, a.dtype.name, a.shape)
    granted, block = self.alloc(a.nbytes, "result")
    np.copyto(block[:a.nbytes], np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return codec.ArenaRef(granted.offset, a.nbytes, granted.generation, a.dtype.name, a.shape)

  def alive(self) -> bool:
    """Whether the sidecar still waits for this job: it sends nothing unasked, so a
    socket with something to read is one it closed (the job's caller gone)."""
    poller = select.poll()
    poller.register(self.sock, select.POLLIN | select.POLLHUP)
    return not poller.poll(0)

  def wait_next(self) -> bool:
    """Waits for the sidecar's next credit; False where it ended the job instead."""
    try:
      m.recv(self.sock, (m.Next,), what="the sidecar")
    except (ConnectionError, OSError):
      return False
    return True


class _Workers:
  """A feed's worker processes, which the sidecar starts and runs (each held to the
  tenant's limits and user): what ``producer`` asks of ``feeds/processes.FeedProcesses``,
  asked of the sidecar. The batches' blocks are named by offset in ``arena``."""

  def __init__(self, asker: Asker, arena: shm.Arena, size: int):
    self._asker, self._arena, self.size = asker, arena, size

  def __enter__(self) -> _Workers:
    self._asker.ask(m.StartWorkers())
    return self

  def __exit__(self, *exc: object) -> None:
    with contextlib.suppress(OSError, errors.SidecarError):
      self._asker.ask(m.StopWorkers())

  def free(self) -> bool:
    return self._asker.ask(m.Free()).free

  def submit(self, step: tuple[int, int], out: list[list[np.ndarray]]) -> tuple[int, int]:
    leaves = tuple(tuple(_offset(self._arena, a) for a in leaf) for leaf in out)
    ticket = self._asker.ask(m.Submit(step[0], step[1], leaves), m.Ticket)
    return ticket.worker, ticket.seq

  def wait(self, ticket: tuple[int, int]) -> float:
    return self._asker.ask(m.Wait(*ticket), m.Waited).seconds


@contextlib.contextmanager
def _reported(sock: socket.socket, limits: limits_lib.ProcessLimits) -> Iterator[None]:
  """Sends what the block raises as the job's ``Error`` (a limit named where the kernel
  held the process to one); a job whose socket is gone ends quietly."""
  try:
    yield
  except (ConnectionError, BrokenPipeError):
    return
  except Exception as e:  # user code's, or ours: the sidecar's caller is told
    with contextlib.suppress(OSError):
      m.send(sock, m.Error(protocol.error_dict(limits.typed(e))))


def _entry(kind: str, name: str, code_hash: str) -> registry_lib.Entry:
  """The registered ``kind`` ``name`` this process imported, the same code as the
  sidecar's (its module unchanged on disk since the sidecar imported it)."""
  entry = registry_lib.default_registry().get(kind, name)
  if entry.code_hash != code_hash:
    raise errors.InvalidArgumentError(
        f"{kind} {name!r} in the tenant's process is not the code the sidecar registered "
        "(its module changed on disk since the sidecar started); restart the sidecar")
  return entry


def _request(payload: bytearray | None) -> tuple[pb.CallRequest, list[memoryview]]:
  raw = payload if payload is not None else bytearray()
  codec.check_message_count(raw, pb.CallRequest.DESCRIPTOR,
                            what=f"a CallRequest of {len(raw)} bytes")
  stripped, views = pbscan.strip_arrays(raw, pb.CallRequest.DESCRIPTOR)
  return codec.parse(pb.CallRequest, stripped, counted=True), views


def serve(sock: socket.socket, arenas: Arenas, limits: limits_lib.ProcessLimits) -> None:
  """Runs the job whose first message comes on ``sock``, then closes it."""
  with sock, _reported(sock, limits):
    job, payload, _ = m.recv(sock, (m.CallJob, m.StreamJob, m.FeedJob, m.ReadJob),
                             payload_limit=REQUEST_MAX, what="the sidecar")
    asker = Asker(sock, arenas)
    if isinstance(job, m.CallJob):
      _call(asker, job, payload)
    elif isinstance(job, m.StreamJob):
      _stream(asker, job, payload)
    elif isinstance(job, m.FeedJob):
      _feed(asker, job, payload)
    else:
      assert isinstance(job, m.ReadJob)
      _read(asker, job)


def _call(asker: Asker, job: m.CallJob, payload: bytearray | None) -> None:
  request, views = _request(payload)
  entry = _entry(registry_lib.FUNCTION, job.name, job.code_hash)
  args, kwargs = calls_lib.decode_arguments(entry, request, from_arena=asker.view,
                                            views=views)
  del views
  with outputs.allocating(asker.empty):
    result = entry.fn(*args, **kwargs)
  del args, kwargs, payload  # a result that is no argument: their memory back first
  where = f"result of {request.name!r}"
  if request.worker_session:
    value = codec.encode(result, to_arena=asker.to_arena, inline_limit=job.inline_limit,
                         where=where)
    raw = pb.CallResponse(result=value).SerializeToString()
  else:
    inline: list[np.ndarray] = []
    value = codec.encode(result, to_arena=functools.partial(_set_aside, inline),
                         inline_limit=pbscan.BIG_ARRAY if job.splice else job.inline_limit,
                         where=where)
    del result
    raw = pbscan.splice_arrays(pb.CallResponse(result=value).SerializeToString(),
                               pb.CallResponse.DESCRIPTOR, inline)
  m.send(asker.sock, m.Response(len(raw)), raw)


def _set_aside(arrays: list[np.ndarray], a: np.ndarray) -> codec.ArenaRef:
  arrays.append(a)
  return codec.ArenaRef(len(arrays) - 1, a.nbytes, 0, a.dtype.name, a.shape)


def _stream(asker: Asker, job: m.StreamJob, payload: bytearray | None) -> None:
  request, views = _request(payload)
  entry = _entry(registry_lib.FUNCTION, job.name, job.code_hash)
  args, kwargs = calls_lib.decode_arguments(entry, request, from_arena=asker.view,
                                            views=views)
  with outputs.allocating(asker.empty):
    items = entry.fn(*args, **kwargs)
  try:
    iterator = iter(items)
  except TypeError:
    raise errors.InvalidArgumentError(
        f"function {job.name!r} returned {type(items).__name__}, not an iterable; streams "
        "need a function that returns an iterable (a generator, say)") from None
  to_arena = asker.to_arena if request.worker_session else None
  index = 0
  try:
    while asker.wait_next():
      try:
        with outputs.allocating(asker.empty):
          item = next(iterator)
      except StopIteration:
        m.send(asker.sock, m.End())
        return
      raw = codec.encode(item, to_arena=to_arena, inline_limit=job.inline_limit,
                         where=f"item {index} of {job.name!r}").SerializeToString()
      m.send(asker.sock, m.Item(len(raw)), raw)
      index += 1
  finally:
    close = getattr(iterator, "close", None)
    if close is not None:
      close()


def _feed(asker: Asker, job: m.FeedJob, payload: bytearray | None) -> None:
  request, views = _request(payload)
  entry = _entry(registry_lib.PIPELINE, job.name, job.code_hash)
  args, kwargs = calls_lib.decode_arguments(entry, request, from_arena=asker.view,
                                            views=views)
  if args:
    raise errors.InvalidArgumentError(
        f"pipeline {job.name!r} takes keyword arguments only, got {len(args)} positional")
  spec = producer.Spec.from_proto(request.feed)
  roots = data_roots.DataRoots.from_dict(job.roots)
  if job.length_only:
    if asker.wait_next():
      m.send(asker.sock, m.Length(producer.length(entry, kwargs, spec, roots, asker.alive)))
    return
  arena = asker.arena(job.arena)  # where the sidecar makes the feed's blocks

  def make_workers() -> _Workers:
    return _Workers(asker, arena, spec.workers)

  def check(sizes: list[int]) -> None:
    asker.ask(m.Check(tuple(sizes)))

  batches = producer.produce(entry, kwargs, spec, asker.batch_array, make_workers, check,
                             roots, asker.alive)
  try:
    while asker.wait_next():
      try:
        batch, state, seconds = next(batches)
      except StopIteration:
        m.send(asker.sock, m.End())
        return
      leaves = tuple(tuple(_offset(arena, a) for a in leaf) for leaf in batch.leaves)
      raw = batch.structure.SerializeToString()
      m.send(asker.sock, m.Batch(len(raw), leaves, state, seconds), raw)
  finally:
    batches.close()


def _offset(arena: shm.Arena, a: np.ndarray) -> int:
  offset = arena.contains(a)
  if offset is None:
    raise errors.InvalidArgumentError("a batch's array lies outside the feed's arena")
  return offset



def _read(asker: Asker, job: m.ReadJob) -> None:
  """A checkpoint shard read from storage, as this process's user: into a block the
  sidecar pinned for it (``to_arena``), else its bytes sent back."""
  record = records.ShardRecord.from_dict(job.record)
  if job.to_arena:
    def allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      granted, block = asker.alloc(nbytes, "read")
      place.append((granted.arena, granted.offset))
      return codec.as_array(block, codec.ArenaRef(granted.offset, nbytes, granted.generation,
                                                  np.dtype(dtype).name, tuple(shape)))
    place: list[tuple[int, int]] = []
  else:
    allocate = lambda shape, dtype: np.empty(shape, dtype)  # noqa: E731  (its own memory)
  data = checkpoint_read.read_stored(job.final_dir, record, allocate=allocate,
                                    checked=job.checked)
  if job.to_arena:
    if not place:
      raise errors.InvalidArgumentError("the format read the shard into no block")
    m.send(asker.sock, m.Data(0, *place[-1]))
    return
  raw = np.asarray(data, order="C").reshape(-1).view(np.uint8)
  m.send(asker.sock, m.Data(raw.nbytes), raw)
