"""Unary calls of registered functions: encode, send within a CallWindow, decode.

Large array arguments go through the host's arena when this process maps it (its
Worker), inline otherwise; ``held`` keeps their blocks until the call ends.

A call to a host whose arena this process maps goes over the Worker's Unix socket
(``socket_calls``), on the calling thread, Ctrl-C polled for. Others go over gRPC: a
call from the main thread is made by a :class:`Callers` thread, so that Ctrl-C can
leave it running: a blocking gRPC call holds a KeyboardInterrupt off until it ends, and
one sent as a future starts a thread of gRPC's for every call (its channel's spin
thread, which ends with the call): half the round trip of a no-op call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from sidecar._src.arena import worker as worker_lib
from sidecar._src.controller import arena_wait, socket_calls
from sidecar._src.controller.connection import MAX_MESSAGE, Connection
from sidecar._src.core import errors, interrupts
from sidecar._src.wire import codec, parts as wire_parts, pbscan, protocol
from sidecar._src.wire.protocol import pb

log = logging.getLogger(__name__)
_NO_ARGS, _NO_KWARGS = codec.encode(()), codec.encode({})  # copied into each request
JOIN_S = 5.0  # how long close() waits for a caller thread (its call's channel is closed)
# A request of at least this many bytes goes in pieces (CallParts), and its response comes
# back in pieces: gRPC's receipt of one message costs the sidecar three times its size, its
# send of one twice; pieces cost them once.
PIECES_FROM = 8 << 20
# What becomes of a call Ctrl-C left: ``abandoned(response, error)`` gets its outcome.
Abandoned = Callable[[Any, BaseException | None], None]


class _Job:
  """One call a caller thread makes; ``done`` is released when it is made, unless the
  main thread left it (``abandoned``), which ``mu`` decides."""

  __slots__ = ("send", "abandon", "mu", "done", "finished", "left", "response", "error")

  def __init__(self, send: Callable[[], Any], abandon: Abandoned):
    self.send, self.abandon = send, abandon
    self.mu = threading.Lock()
    self.done = threading.Lock()
    self.done.acquire()
    self.finished = self.left = False
    self.response: Any = None
    self.error: BaseException | None = None

  def run(self) -> None:
    try:
      response, error = self.send(), None
    except BaseException as e:  # the caller's to raise (a RpcError, gRPC's ValueError)
      response, error = None, e
    with self.mu:
      self.response, self.error, self.finished = response, error, True
      left = self.left
    if left:
      self.abandon(response, error)
    else:
      self.done.release()


class Callers:
  """Long-lived threads that make the main thread's blocking calls.

  :meth:`run` hands a call to an idle thread (a new one if none is idle: only after
  Ctrl-C left one running) and waits for it with SIGINT deferred (``interrupts``), so
  Ctrl-C ends the wait at once, never inside gRPC's locks. ``close()`` joins them.
  """

  def __init__(self, name: str = "sidecar-call"):
    self._name = name
    self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
    self._mu = threading.Lock()
    self._threads: list[threading.Thread] = []
    self._idle = 0
    self._closed = False

  def run(self, send: Callable[[], Any], *, abandoned: Abandoned) -> Any:
    """``send()``'s result, made on a caller thread; its error raised here.

    Raises:
      KeyboardInterrupt: Ctrl-C came first; the call goes on and ``abandoned`` gets its
        outcome (on the caller thread, or here if it came meanwhile).
      ClosedError: after :meth:`close`.
    """
    job = _Job(send, abandoned)
    self._submit(job)
    try:
      while not job.done.acquire(timeout=interrupts.POLL_S):
        interrupts.check()
    except KeyboardInterrupt:
      with job.mu:
        job.left = True
        finished = job.finished
      if finished:  # it came as Ctrl-C did: dropped here
        abandoned(job.response, job.error)
      raise
    if job.error is not None:
      raise job.error
    return job.response

  def start(self, fn: Callable[[], None]) -> None:
    """Runs ``fn`` on a caller thread and returns at once (``close()`` joins it)."""
    job = _Job(fn, lambda response, error: None)
    job.left = True  # nobody waits for it
    self._submit(job)

  def _submit(self, job: _Job) -> None:
    with self._mu:
      if self._closed:
        raise errors.ClosedError("the controller's calls are closed")
      if self._idle:
        self._idle -= 1  # that thread takes this job
      else:
        t = threading.Thread(target=self._loop, daemon=True,
                             name=f"{self._name}-{len(self._threads)}")
        self._threads.append(t)
        t.start()
      self._jobs.put(job)

  def _loop(self) -> None:
    while True:
      job = self._jobs.get()
      if job is None:
        return
      job.run()
      del job  # nothing of a call outlives it here (its result's arena views)
      with self._mu:
        self._idle += 1

  def close(self) -> None:
    """Stops and joins the threads (after their calls); idempotent."""
    with self._mu:
      self._closed = True
      threads, self._threads = self._threads, []
    for _ in threads:
      self._jobs.put(None)
    for t in threads:
      t.join(JOIN_S)
      if t.is_alive():
        log.warning("%s still runs a call %.0f s after close(); its channel is closed, "
                    "it ends within the call's deadline", t.name, JOIN_S)


class Calls:
  """Runs registered functions on sidecars, through one controller's connections.

  Args:
    connection: the Connection to a host id.
    worker: the Worker that maps a host id's arena here, or None.
  """

  def __init__(self, *, connection: Callable[[int], Connection],
               worker: Callable[[int], worker_lib.Worker | None]):
    self._connection = connection
    self._worker = worker
    self._callers = Callers()
    self._lock = threading.Lock()
    self._lanes: dict[int, socket_calls.Lanes] = {}  # per host, over its Worker's socket
    self._closed = False

  def request(self, host_id: int, name: str, args: tuple, kwargs: dict, timeout: float,
              held: list) -> pb.CallRequest:
    """The request for ``name(*args, **kwargs)`` on ``host_id``; arena blocks go in ``held``."""
    if not isinstance(name, str):
      raise errors.InvalidArgumentError(f"name must be a str, got {name!r}")
    w = self._worker(host_id)
    to_arena = None
    if w is not None:
      def to_arena(a):
        ref = w.ref_of(a)
        if ref is not None:  # already in the arena: send the descriptor only
          held.append(a)
          return ref
        dst, ref = w.put(a, timeout=timeout)
        held.append(dst)  # This side holds argument blocks until the call ends.
        return ref
    return pb.CallRequest(
        name=name, args=codec.encode(tuple(args), to_arena=to_arena, where="args") if args
        else _NO_ARGS, kwargs=codec.encode(dict(kwargs), to_arena=to_arena, where="kwargs")
        if kwargs else _NO_KWARGS, worker_session=w.session if w is not None else "")

  def decode(self, host_id: int, name: str, response: pb.CallResponse | Parted) -> Any:
    w = self._worker(host_id)
    views = None
    if isinstance(response, Parted):  # its large arrays view the buffer it came into
      views = response.views
      response = response.response
    return codec.decode(response.result, from_arena=w.view if w else None,
                        where=f"result of {name!r} from host {host_id}", views=views)

  def call_sync(self, host_id: int, name: str, args: tuple, kwargs: dict,
                timeout: float) -> Any:
    """Runs ``name`` on ``host_id`` on this thread; Ctrl-C leaves it running."""
    conn, held = self._connection(host_id), []
    deadline = time.monotonic() + timeout
    request = self.request(host_id, name, args, kwargs, timeout, held)
    try:
      entered = conn.calls.enter(deadline - time.monotonic())
    except BaseException:  # closed, or Ctrl-C: the arguments' blocks go back now
      held.clear()
      raise
    if not entered:
      held.clear()
      raise conn.calls.waited_too_long(f"call {name!r} on host {host_id}", timeout)
    w = self._worker(host_id)
    if w is not None:  # the fast path: over its Unix socket
      response = self._exchange(w, host_id, name, request, deadline, timeout,
                                slot=conn.calls.exit, end=held.clear)
      return self.decode(host_id, name, response)
    leave = True  # give the window's slot back here (not when a call outlives Ctrl-C)
    try:
      left = max(deadline - time.monotonic(), 0.0)
      if threading.current_thread() is not threading.main_thread():
        response = call_rpc(conn, request)(request, timeout=left, metadata=conn.metadata)
      else:  # on a caller thread, which Ctrl-C can leave: the main thread's would hold it
        kept = list(held)  # if Ctrl-C leaves the call: its arguments' blocks, until it ends
        try:
          response = self._callers.run(
              lambda: call_rpc(conn, request)(request, timeout=left, metadata=conn.metadata),
              abandoned=lambda r, e: self._drop(host_id, name, r, kept, conn))
        except KeyboardInterrupt:
          # The call goes on (within its deadline), holding its arguments' blocks; what
          # it returns is dropped then, so its result's blocks go back too.
          leave = False
          raise
    except grpc.RpcError as e:
      error = protocol.error_from_rpc(e, host=conn.address, host_id=host_id)
      if not isinstance(error, errors.SessionLostError):
        raise error from None
      conn.renew()  # the sidecar lost our session (a flood evicted it): once more, anew
      left = max(deadline - time.monotonic(), 0.0)
      try:
        response = call_rpc(conn, request)(request, timeout=left, metadata=conn.metadata)
      except grpc.RpcError as e2:
        raise protocol.error_from_rpc(e2, host=conn.address, host_id=host_id) from None
    except ValueError:
      if conn.calls.closed:  # gRPC's "Channel closed!": the controller closed meanwhile
        raise errors.ClosedError(f"call {name!r} on host {host_id}: the connection "
                                 "closed") from None
      raise
    finally:
      held.clear()
      if leave:
        conn.calls.exit()
    return self.decode(host_id, name, response)

  def _exchange(self, w: worker_lib.Worker, host_id: int, name: str, request: pb.CallRequest,
                deadline: float, timeout: float, *, slot: Callable[[], None],
                end: Callable[[], None]) -> pb.CallResponse:
    """``request``'s response over a lane of ``w``'s Unix socket.

    ``slot()`` gives back the call's slot in the window, ``end()`` what the call holds
    (its arguments' blocks); each runs once. Both run here when the call ends here. Where
    the caller leaves first, a caller thread reads the response and drops it (its result's
    blocks go back), then runs ``end()``; the slot goes back at the caller's deadline
    (at once, when that is why it left), as a gRPC call's does, so calls left running
    never hold up the next. A main thread's wait polls for Ctrl-C (``interrupts``).
    """
    lane = None
    try:
      w.check_usable()
      lanes = self._lanes_of(host_id, w)
      lane = lanes.take()
      request.timeout_s = max(deadline - time.monotonic(), 1e-3)
      lane.send(request)
    except BaseException:
      if lane is not None:
        lanes.give_back(lane, usable=False)
      slot()
      end()
      raise
    # A silent sidecar is asked for a sign of life (its Worker's connection answers while
    # the call runs): a stopped or hung one ends the call with HostLostError within about
    # the peer timeout, as gRPC's keepalive does.
    quiet_s = w.quiet_s
    poll = interrupts.POLL_S if threading.current_thread() is threading.main_thread() else (
        min(quiet_s, arena_wait.EVERY_S))
    heard = started = time.monotonic()
    room = arena_wait.ArenaWait(self._connection(host_id), host_id, name, timeout)
    try:
      while (response := lane.receive(_wait(deadline, poll))) is None:
        interrupts.check()  # Ctrl-C: KeyboardInterrupt
        room.look()  # a wait for arena room says so (a pool's admission queue)
        now = time.monotonic()
        if now >= deadline:
          raise errors.DeadlineExceededError(
              f"call {name!r} on host {host_id} gave no result within its timeout of "
              f"{timeout:.3g} s; it goes on in the sidecar, and its result is dropped")
        if now - heard >= quiet_s:
          try:
            w.check_alive(quiet_s)
          except errors.HostLostError as e:
            raise errors.HostLostError(
                f"call {name!r} on host {host_id} had no result for {now - started:.3g} s, "
                f"and {e}", host_id=host_id) from None
          heard = time.monotonic()
    except errors.HostLostError:
      lanes.give_back(lane, usable=False)
      slot()
      end()
      raise
    except errors.DeadlineExceededError:  # it runs on; its slot goes back now
      slot()
      self._callers.start(lambda: self._drain(lanes, lane, host_id, name, deadline, None, end))
      raise
    except BaseException:  # Ctrl-C: it runs on, its slot held until its deadline
      self._callers.start(lambda: self._drain(lanes, lane, host_id, name, deadline, slot, end))
      raise
    finally:
      room.close()
    lanes.give_back(lane)
    slot()
    end()
    if response.HasField("error"):
      raise protocol.error_from_info(response.error, host=w.path, host_id=host_id)
    return response

  def _lanes_of(self, host_id: int, w: worker_lib.Worker) -> socket_calls.Lanes:
    """``w``'s lanes (a Worker made anew, after a restart, gets new ones)."""
    with self._lock:
      if self._closed:
        raise errors.ClosedError("the controller's calls are closed")
      lanes = self._lanes.get(host_id)
      if lanes is not None and lanes.worker is w:
        return lanes
      self._lanes[host_id] = fresh = socket_calls.Lanes(w)
    if lanes is not None:
      lanes.close()
    return fresh

  def _drain(self, lanes: socket_calls.Lanes, lane: socket_calls.Lane, host_id: int,
             name: str, deadline: float, slot: Callable[[], None] | None,
             end: Callable[[], None]) -> None:
    """Reads the response of a call its caller left and drops it (its result's blocks go
    back); ``slot()`` (if given) at the response or at ``deadline``, whichever comes
    first; then ``end()``."""
    try:
      response = None
      if slot is not None:
        while response is None and time.monotonic() < deadline:
          response = lane.receive(max(deadline - time.monotonic(), 1e-3))
        give, slot = slot, None  # once: not again below
        give()
      if response is None:
        response = lane.receive(None)  # until it comes, or close() closes the lane
    except errors.SidecarError:
      lanes.give_back(lane, usable=False)
    else:
      lanes.give_back(lane)
      if response is not None and not response.HasField("error"):
        with contextlib.suppress(Exception):  # its caller is gone: nobody to tell
          self.decode(host_id, name, response)  # views made and dropped at once
    finally:
      if slot is not None:  # the lane failed before the deadline
        slot()
      end()

  def _drop(self, host_id: int, name: str, response: pb.CallResponse | Parted | None,
            held: list, conn: Connection) -> None:
    """Decodes and drops the result of a call nobody waits for: its blocks go back."""
    conn.calls.exit()
    held.clear()
    if response is None:
      return  # it failed; its error has nobody to reach
    try:
      self.decode(host_id, name, response)
    except Exception:  # the caller is gone; its error has nobody to reach
      pass

  def close(self) -> None:
    """Closes the Unix-socket lanes and joins the threads that made this controller's
    calls (or read the responses of those Ctrl-C left); idempotent."""
    with self._lock:
      self._closed = True
      lanes, self._lanes = list(self._lanes.values()), {}
    for lane_pool in lanes:
      lane_pool.close()
    self._callers.close()

  def call_future(self, host_id: int, name: str, args: tuple, kwargs: dict,
                  timeout: float) -> concurrent.futures.Future:
    """Runs ``name`` on ``host_id``; its result (or error) in a Future."""
    conn, held = self._connection(host_id), []
    out: concurrent.futures.Future = concurrent.futures.Future()
    try:
      request = self.request(host_id, name, args, kwargs, timeout, held)
    except Exception as e:
      out.set_exception(e)
      return out

    deadline = time.monotonic() + timeout
    w = self._worker(host_id)
    if w is not None:  # over its Unix socket, from a caller thread
      _SocketCall(self, w, conn, host_id, name, request, held, out, deadline=deadline,
                  timeout=timeout).send()
    else:
      _Call(self, conn, host_id, name, request, held, out, deadline=deadline).send()
    return out


class _SocketCall:
  """One ``call_future`` over a Worker's socket: it waits for a slot in the window as a
  gRPC call does, then a caller thread makes it. ``ended`` (what the window waits for)
  resolves once the call is over, ``out`` once its result or error is known (at its
  timeout, before a late result comes and is dropped). Nothing here refers back to this
  object once the call is over (see :class:`_Call`)."""

  def __init__(self, calls: Calls, w: worker_lib.Worker, conn: Any, host_id: int, name: str,
               request: pb.CallRequest, held: list, out: concurrent.futures.Future, *,
               deadline: float, timeout: float):
    self.calls, self.w, self.conn, self.host_id, self.name = calls, w, conn, host_id, name
    self.request, self.held, self.out = request, held, out
    self.deadline, self.timeout = deadline, timeout

  def send(self) -> None:
    self.conn.calls.call(self.start, done=self.done, fail=self.fail,
                         timeout=self.deadline - time.monotonic(),
                         what=f"call {self.name!r} on host {self.host_id}")

  def start(self, left: float) -> concurrent.futures.Future:
    ended: concurrent.futures.Future = concurrent.futures.Future()
    self.calls._callers.start(lambda: self.run(ended))
    return ended

  def run(self, ended: concurrent.futures.Future) -> None:
    try:
      response = self.calls._exchange(self.w, self.host_id, self.name, self.request,
                                      self.deadline, self.timeout,
                                      slot=lambda: ended.set_result(None), end=self.held.clear)
      self.out.set_result(self.calls.decode(self.host_id, self.name, response))
    except Exception as e:
      self.out.set_exception(e)

  def done(self, ended: concurrent.futures.Future) -> None:
    pass  # its slot is back; its arguments' blocks go back when the call ends (``end``)

  def fail(self, e: BaseException) -> None:
    self.held.clear()
    self.out.set_exception(e)


class _Call:
  """One ``call_future`` in flight. Its callbacks are bound methods of this object, which
  nothing refers back to: once gRPC and the slot let go of them, the result's arena views
  are the future's alone (closures calling one another made a cycle that held every
  result's blocks until the garbage collector ran)."""

  def __init__(self, calls: Calls, conn: Any, host_id: int, name: str,
               request: pb.CallRequest, held: list, out: concurrent.futures.Future, *,
               deadline: float):
    self.calls, self.conn, self.host_id, self.name = calls, conn, host_id, name
    self.request, self.held, self.out, self.deadline = request, held, out, deadline
    self.renewed = False

  def send(self) -> None:
    request, conn = self.request, self.conn
    conn.calls.call(  # the wait for a slot counts toward the timeout
        lambda left: call_rpc(conn, request, start=self.calls._callers.start).future(
            request, timeout=left, metadata=conn.metadata),
        done=self.done, fail=self.fail, timeout=self.deadline - time.monotonic(),
        what=f"call {self.name!r} on host {self.host_id}")

  def done(self, f: grpc.Future) -> None:
    try:
      self.out.set_result(self.calls.decode(self.host_id, self.name, f.result()))
    except grpc.RpcError as e:
      error = protocol.error_from_rpc(e, host=self.conn.address, host_id=self.host_id)
      if isinstance(error, errors.SessionLostError) and not self.renewed:
        self.renewed = True  # the sidecar lost our session: once more, anew, off gRPC's thread
        threading.Thread(target=self.again, name="sidecar-renew", daemon=True).start()
        return
      self.out.set_exception(error)
    except Exception as e:
      self.out.set_exception(e)
    self.held.clear()

  def fail(self, e: BaseException) -> None:
    self.held.clear()
    self.out.set_exception(e)

  def again(self) -> None:
    try:
      self.conn.renew()
    except Exception as e:
      self.fail(e)
      return
    self.send()


def _wait(deadline: float, poll: float) -> float:
  """How long to wait for a response: until ``deadline``, in steps of ``poll``; never 0,
  which would make the socket non-blocking (EAGAIN, not a timeout)."""
  return min(max(deadline - time.monotonic(), 1e-3), poll)


@dataclasses.dataclass(frozen=True, slots=True)
class Parted:
  """A CallResponse that came in parts (CallParts): its large arrays' bytes left in the
  one buffer its parts were copied into, as ``views`` of it for the decoder, which makes
  the result's arrays views of them (``pbscan.strip_arrays``): no copy of its own."""
  response: pb.CallResponse
  views: list[memoryview]


def call_rpc(conn: Connection, request: pb.CallRequest, *,
             start: Callable[[Callable[[], None]], None] | None = None) -> Any:
  """The rpc that sends ``request`` to ``conn``'s sidecar: Call, or CallParts for one of
  ``PIECES_FROM`` bytes or more (called the same way: ``rpc(request, ...)``,
  ``rpc.future(request, ...)``; CallParts' future reads its response's parts on a thread
  ``start`` runs, whose owner joins it).

  Its response: a ``pb.CallResponse``, or a :class:`Parted` from CallParts.
  """
  if request.ByteSize() < PIECES_FROM:
    return conn.call_rpc
  return _InPieces(conn.call_pieces_rpc, start)


class _InPieces:
  """A CallParts rpc called as Call is: with the request, made into its parts each time
  (a renewed session sends them again), its response put together from its parts."""

  def __init__(self, stub: grpc.StreamStreamMultiCallable,
               start: Callable[[Callable[[], None]], None] | None):
    self._stub, self._start = stub, start

  def __call__(self, request: pb.CallRequest, **kw: Any) -> Parted:
    """The response, read part by part into one buffer.

    Raises:
      grpc.RpcError: the call failed (before or between parts: its status).
      ResourceExhaustedError: the response is larger than ``MAX_MESSAGE``, which one
        message of it could not have been either.
      InvalidArgumentError: its parts do not add up.
    """
    responses = self._stub(_pieces(request), **kw)
    try:
      first = next(responses, None)
      if first is None:
        raise errors.InvalidArgumentError(
            f"the response to call {request.name!r} ended before its first part")
      total = codec.parse(pb.CallPart, first).total
      if total > MAX_MESSAGE:
        raise errors.ResourceExhaustedError(
            f"the result of call {request.name!r} is {total} bytes, more than a controller "
            f"takes ({MAX_MESSAGE} bytes); return large arrays through a Worker's arena")
      buffer = wire_parts.assemble(total, itertools.chain((first,), responses),
                                   what="the response")
    except BaseException:
      responses.cancel()  # nothing more is read: the sidecar stops sending
      raise
    stripped, views = pbscan.strip_arrays(buffer, pb.CallResponse.DESCRIPTOR)
    return Parted(codec.parse(pb.CallResponse, stripped), views)

  def future(self, request: pb.CallRequest, **kw: Any) -> concurrent.futures.Future:
    """A future of :meth:`__call__`'s response (or its error), read on a thread of
    ``start``'s."""
    if self._start is None:
      raise TypeError("a CallParts future needs a thread to read its parts: pass start=")
    out: concurrent.futures.Future = concurrent.futures.Future()

    def read() -> None:
      try:
        out.set_result(self(request, **kw))
      except Exception as e:  # the future's to raise (a RpcError, as gRPC's would)
        out.set_exception(e)

    self._start(read)
    return out


def _pieces(request: pb.CallRequest):
  """``request`` serialized, in serialized CallParts (the first with the total)."""
  raw = request.SerializeToString()
  yield from wire_parts.cut([raw], len(raw))
